"""`splitserve up --served-model-name NAME --api-key KEY`: the commands the start-up banner suggests work exactly as
printed (run by a shell whose only addition is PD_API_KEY), a request without the key gets 401, and the key reaches
the router through its environment alone (on no child's command line, in no other child's environment)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from splitserve.launcher import free_port
from tests.cluster import TEST_ENV, read_up_banner

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "up-banner-key-5f1c"


def banner_commands(banner: str) -> tuple[str, str]:
    """(the curl command, the ``splitserve generate`` command) of the banner's "try:" block, as printed."""
    block = banner.split("\ntry:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    start = next(i for i, line in enumerate(block) if line.strip().startswith("curl "))
    end = start
    while block[end].endswith("\\"):
        end += 1
    curl = "\n".join(block[start : end + 1])
    generate = next(line.strip() for line in block if line.strip().startswith("splitserve generate "))
    return curl, generate


def child_pids(pid: int) -> dict[str, int]:
    """`splitserve up`'s children by command (router, prefill, ...)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    children = {}
    for p in map(int, out.split()):
        argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        children[argv[argv.index(b"splitserve.cli") + 1].decode()] = p
    return children


def shell(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)


def test_banner_commands_work_as_printed_with_a_served_model_name_and_an_api_key():
    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    http_port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "PD_API_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--served-model-name", "my-model", "--api-key", KEY,
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--kv-cache-mb", "32", "--no-store"],
        env={**env, **TEST_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        banner = "".join(read_up_banner(proc))
        assert "Ctrl-C stops the cluster" in banner, banner
        assert KEY not in banner
        curl, generate = banner_commands(banner)
        assert '"model": "my-model"' in curl and '-H "Authorization: Bearer $PD_API_KEY"' in curl

        # a user's shell: the venv's `splitserve` on PATH, the key in PD_API_KEY, nothing else added
        user = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", "PD_API_KEY": KEY}
        out = shell(curl, user)
        assert out.returncode == 0, out.stderr
        events = [line.removeprefix("data: ") for line in out.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", out.stdout
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["model"] for c in chunks} == {"my-model"}
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        curl_text = "".join(c["choices"][0]["text"] for c in chunks)
        assert curl_text.strip()

        gen = shell(generate, user)
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.startswith(curl_text)  # greedy: its 64 tokens begin with the curl's 48

        # without the key: 401 over HTTP, UNAUTHENTICATED over gRPC
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=30,
                       json={"model": "my-model", "prompt": "Once upon a time", "max_tokens": 4})
        assert r.status_code == 401, r.text
        no_key = shell(generate, {k: v for k, v in user.items() if k != "PD_API_KEY"})
        assert no_key.returncode == 1 and no_key.stderr.startswith("error: UNAUTHENTICATED"), no_key.stderr

        children = child_pids(proc.pid)
        assert {"router", "prefill", "decode"} <= set(children), children
        for name, pid in children.items():
            assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
            has_key = f"PD_API_KEY={KEY}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert has_key == (name == "router"), name
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
