"""``Cluster.stop`` stops the KV store's storage nodes before its master, so a node unmounts its segment from a
master that still answers (no "unmount failed (master gone?)" line at an ordered shutdown)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from splitserve.launcher import Child, Cluster

pytestmark = pytest.mark.process

# On SIGTERM: log "<name>-term"; a node then waits (at most 2 s) for the master's "master-term" line before it
# logs "<name>-exit" and exits, so a master stopped together with its nodes shows up before their exit.
SCRIPT = """
import os, signal, sys, time
name, log = sys.argv[1], sys.argv[2]
def write(line):
    with open(log, "a") as f:
        f.write(line + "\\n")
def on_term(*_):
    write(name + "-term")
    if name != "kvstore-master":
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and "master-term" not in open(log).read():
            time.sleep(0.02)
    write(name + "-exit")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
write(name + "-ready")
while True:
    time.sleep(1)
"""


def test_storage_nodes_stop_before_the_master(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.touch()
    names = ["kvstore-master", "kvstore-node-0", "kvstore-node-1"]  # the launcher lists the master first
    cluster = Cluster([Child(n, [sys.executable, "-c", SCRIPT, n, str(log)], health="grpc:127.0.0.1:1") for n in names])
    cluster.start()
    try:
        deadline = time.monotonic() + 30
        while sum(line.endswith("-ready") for line in log.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline, "children did not start"
            time.sleep(0.05)
    finally:
        cluster.stop(grace_s=30)
    lines = log.read_text().splitlines()
    for node in names[1:]:
        assert lines.index(f"{node}-exit") < lines.index("kvstore-master-term"), lines


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch):
    """A cluster draws its ports before binding any: an equal draw must not be returned twice."""
    from splitserve import launcher

    draws = iter([24001, 24001, 24002])
    monkeypatch.setattr(launcher._PORTS, "randrange", lambda a, b: next(draws))
    monkeypatch.setattr(launcher, "_HANDED_OUT", set())
    assert [launcher.free_port(), launcher.free_port()] == [24001, 24002]
