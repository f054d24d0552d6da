"""`splitserve up` starts separate processes, serves, and stops them all on SIGINT (no orphans)."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from splitserve.launcher import free_port
from tests.cluster import TEST_ENV, read_up_banner

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}/stat") else "X"
    return stat != "Z"


def test_up_serves_and_stops_cleanly():
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--kv-cache-mb", "32",
         "--store-mb", "32"],
        env={**os.environ, **TEST_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = read_up_banner(proc)
        out = "".join(lines)
        assert f"http://127.0.0.1:{http_port}/v1" in out, out
        kids = _children(proc.pid)
        assert len(kids) == 5  # router, prefill, decode, KV store master and storage node: separate OS processes
        assert "kvstore-master" in out and "kvstore-node-0" in out and out.count("SERVING") >= 2
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",
                       json={"model": "TinyStories-656K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        gen = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--router", f"127.0.0.1:{grpc_port}",
                              "--max-tokens", "8", "Once upon a time"], capture_output=True, text=True, timeout=60)
        assert gen.returncode == 0 and gen.stdout.strip() == r.json()["choices"][0]["text"].strip()
        # Ctrl-C drains: a stream in flight completes in full, then everything exits 0
        body = {"model": "TinyStories-656K", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # streaming has started
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"completion_tokens":400' in rest[-2].replace(" ", "")
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert not [k for k in kids if _alive(k)]
    finally:
        if proc.poll() is None:
            proc.kill()
