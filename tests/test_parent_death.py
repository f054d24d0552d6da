"""A process started by the launcher dies with it (PR_SET_PDEATHSIG, armed by the child itself at start-up:
splitserve.parent_death), without the launcher's former ``preexec_fn`` (which forced a fork() of a process running
gRPC/UCX threads, and once left a child spinning before exec, holding up its launcher)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from splitserve import launcher, parent_death

pytestmark = pytest.mark.integration

LAUNCHER = """
import sys, time
from splitserve.launcher import Child, Cluster, free_port
port = free_port()
c = Cluster([Child("kvstore-master", [sys.executable, "-m", "splitserve.cli", "kvstore-master", "--host", "127.0.0.1",
                                      "--port", str(port), "--metrics-port", "0"], f"grpc:127.0.0.1:{port}")], {})
c.start()
c.wait_healthy(timeout_s=60)
print(c.children[0].proc.pid, flush=True)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_child_dies_with_its_launcher_killed_outright():
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()


def test_the_launcher_forks_no_preexec_fn(monkeypatch):
    seen = {}

    class FakePopen:
        def __init__(self, argv, **kw):
            seen.update(kw)

    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    c = launcher.Cluster([launcher.Child("x", ["true"], "grpc:127.0.0.1:1")], {})
    c.start()
    assert "preexec_fn" not in seen and seen["env"][parent_death.PARENT_PID_ENV] == str(os.getpid())


def test_not_started_by_a_launcher_arms_nothing(monkeypatch):
    monkeypatch.delenv(parent_death.PARENT_PID_ENV, raising=False)
    assert parent_death.arm_from_env() is False


ARM = """
import os
from splitserve.parent_death import PARENT_PID_ENV, arm_from_env
os.environ[PARENT_PID_ENV] = os.environ.pop("PARENT_FOR_TEST")
print(arm_from_env(), PARENT_PID_ENV in os.environ, flush=True)
"""


def test_arming_takes_the_variable_out_and_a_parent_already_gone_ends_the_child_at_once():
    ok = subprocess.run([sys.executable, "-c", ARM], env={**os.environ, "PARENT_FOR_TEST": str(os.getpid())},
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.split() == ["True", "False"], ok.stderr
    gone = subprocess.run([sys.executable, "-c", ARM], env={**os.environ, "PARENT_FOR_TEST": "1"},  # not its parent
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == -signal.SIGTERM and gone.stdout == ""
