"""``splitserve bench compare``: the same model and workload on each serving configuration in turn.

Configurations (one after another on the same cores):

* ``colocated-unchunked``: ``splitserve colocated`` (prefill-first), pinned to all given cores,
  ``--torch-threads`` = number of those cores.
* ``colocated-chunked``: the same with ``--enable-chunked-prefill --max-num-batched-tokens N``.
* ``disaggregated``: router + 1 prefill worker pinned to one core + 1 decode worker pinned to
  another, one torch thread each; the router is not pinned (as the benchmark client).

Each server is started, checked healthy, warmed up with a few requests, measured, and stopped
before the next one starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from splitserve.bench.client import run_requests
from splitserve.bench.metrics import SLO
from splitserve.bench.pin import pinned
from splitserve.cpus import parse_cpus
from splitserve.bench.report import RunResult
from splitserve.bench.sysload import CpuWindow
from splitserve.bench.workloads import RequestSpec, Workload
from splitserve.launcher import Child, Cluster, build_cluster, free_port

logger = logging.getLogger(__name__)

CONFIGS = ("colocated-unchunked", "colocated-chunked", "disaggregated")


@dataclass(frozen=True)
class ServerSettings:
    """What every configuration shares, plus the chunked budget and the core assignment."""

    model: str
    kv_cache_mb: int = 512
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256  # chunked-prefill token budget per step
    colocated_cpus: str = "0,1"
    prefill_cpus: str = "0"
    decode_cpus: str = "1"
    host: str = "127.0.0.1"
    nice: int | None = None  # nice value of every server process (None: inherit)


def _env() -> dict[str, str]:
    env = {"PD_LOG_LEVEL": os.environ.get("PD_LOG_LEVEL", "WARNING")}
    if "UCX_NET_DEVICES" not in os.environ:
        env["UCX_NET_DEVICES"] = "lo"  # one machine: KV moves over loopback
    return env


def build_config(config: str, s: ServerSettings) -> tuple[Cluster, str]:
    """The processes of ``config`` (not started) and its HTTP base URL.

    Raises:
        ValueError: unknown configuration or bad CPU list.
    """
    py = [sys.executable, "-m", "splitserve.cli"]
    engine = ["--model", s.model, "--kv-cache-mb", str(s.kv_cache_mb), "--block-size", str(s.block_size),
              "--max-num-seqs", str(s.max_num_seqs)]
    if config in ("colocated-unchunked", "colocated-chunked"):
        http_port, grpc_port = free_port(s.host), free_port(s.host)
        threads = len(parse_cpus(s.colocated_cpus))
        argv = [*py, "colocated", *engine, "--torch-threads", str(threads), "--host", s.host,
                "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
        if config == "colocated-chunked":
            argv += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        child = Child("colocated", pinned(s.colocated_cpus, argv, s.nice), f"http://{s.host}:{http_port}/health")
        return Cluster([child], _env()), f"http://{s.host}:{http_port}"
    if config == "disaggregated":
        cluster, http_port, _ = build_cluster(model=s.model, num_prefill=1, num_decode=1, host=s.host, http_port=0,
                                              grpc_port=0, worker_args=[*engine[2:], "--torch-threads", "1"], env=_env())
        everywhere = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        for child in cluster.children:
            if child.name.startswith("prefill"):
                child.argv = pinned(s.prefill_cpus, child.argv, s.nice)
            elif child.name.startswith("decode"):
                child.argv = pinned(s.decode_cpus, child.argv, s.nice)
            elif s.nice is not None:  # the router floats, like the benchmark client
                child.argv = pinned(everywhere, child.argv, s.nice)
        return cluster, f"http://{s.host}:{http_port}"
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def command_lines(cluster: Cluster) -> list[str]:
    lines = []
    for c in cluster.children:
        cmd = " ".join(c.argv[c.argv.index("splitserve.cli") + 1:] if "splitserve.cli" in c.argv else c.argv)
        if "splitserve.bench.pin" in c.argv:
            pin = c.argv[c.argv.index("splitserve.bench.pin") + 1: c.argv.index("--")]
            cmd = f"taskset -c {pin[0]} " + (f"nice -n {pin[1]} " if len(pin) > 1 else "") + "splitserve " + cmd
        else:
            cmd = "splitserve " + cmd
        lines.append(cmd)
    return lines


def warmup_specs(workload: Workload, n: int = 3) -> list[RequestSpec]:
    """The first request of each class (then the first few), with 4 output tokens."""
    firsts = {}
    for r in workload.requests:
        firsts.setdefault(r.kind, r)
    picked = list(firsts.values()) + [r for r in workload.requests if r not in firsts.values()]
    return [replace(r, index=i, max_tokens=4) for i, r in enumerate(picked[:n])]


def run_config(
    config: str, settings: ServerSettings, workload: Workload, served_name: str, *, arrivals_s: list[float] | None,
    concurrency: int | None, slo: SLO, progress: bool = True, timeout_s: float = 600.0,
) -> RunResult:
    """Start ``config``, warm it up, run the workload, stop it; returns the measured run."""
    cluster, url = build_config(config, settings)
    logger.info("starting %s", config)
    cluster.start()
    try:
        cluster.wait_healthy(timeout_s=300)
        asyncio.run(_warmup(url, served_name, workload))
        pids = [c.proc.pid for c in cluster.children] + [os.getpid()]
        window = CpuWindow.start(pids)
        records, duration = asyncio.run(run_requests(url, served_name, workload.requests, arrivals_s=arrivals_s,
                                                     concurrency=concurrency, timeout_s=timeout_s, progress=progress, desc=config))
        cpu = window.stop()
    finally:
        cluster.stop()
    return RunResult(config, records, duration, slo, {"url": url, "commands": command_lines(cluster), "cpu": cpu})


async def _warmup(url: str, served_name: str, workload: Workload) -> None:
    specs = warmup_specs(workload)
    records, _ = await run_requests(url, served_name, specs, concurrency=len(specs), progress=False)
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[0]}")


def targets(workload: Workload, results: list[RunResult]) -> list[str]:
    """The issue's targets for this workload, each MET or MISSED with the margin."""
    by = {r.config: r.summary for r in results}
    u, c, d = (by.get(k) for k in CONFIGS)
    lines = []
    if workload.name == "synthetic-mixed" and u and d:
        du, dd = u["itl_ms"]["p99"], d["itl_ms"]["p99"]
        goal = du / 3
        lines.append(f"p99 ITL: disaggregated {dd:.0f} ms vs colocated-unchunked {du:.0f} ms (ratio {dd / du:.2f}; target ≤ 0.33): "
                     + (f"MET ({goal - dd:.0f} ms to spare)" if dd <= goal else f"MISSED by {dd - goal:.0f} ms ({dd / goal:.2f}× the limit)"))
        if c:
            dc = c["itl_ms"]["p99"]
            lines.append(f"p99 ITL: disaggregated {dd:.0f} ms vs colocated-chunked {dc:.0f} ms (target ≤ 1.0×, ratio {dd / dc:.2f}): "
                         + ("MET" if dd <= dc else f"MISSED by {dd - dc:.0f} ms"))
    if workload.name in ("mooncake", "azure") and u and d:
        gu, gd = u["goodput_rps"], d["goodput_rps"]
        ratio = gd / gu if gu else float("inf")
        lines.append(f"goodput: disaggregated {gd:.3f} req/s vs colocated-unchunked {gu:.3f} req/s (ratio {ratio:.2f}; target ≥ 1.5): "
                     + ("MET" if ratio >= 1.5 else f"MISSED by {1.5 - ratio:.2f} (ratio)"))
        if c:
            gc = c["goodput_rps"]
            lines.append(f"goodput vs colocated-chunked: {gd:.3f} vs {gc:.3f} req/s "
                         f"(ratio {gd / gc if gc else float('inf'):.2f}; reported, no target)")
    return lines


def outputs_dir(base: str | None, name: str) -> Path:
    import time

    return Path(base) if base else Path("bench-out") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
