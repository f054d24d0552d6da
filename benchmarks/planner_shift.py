"""Planner benchmark: a workload whose mix shifts chat-heavy -> document-heavy -> chat-heavy, on 4 workers whose
role can change, served with every static P:D split and with the planner, in one run on the same cores.

Starts 4 `splitserve worker` processes once (no KV store), then for each configuration sets the workers' roles with
SetRole (static 1P:3D, 2P:2D, 3P:1D; the planner starts at 2P:2D), starts a router over them (``--workers``; the
planner's run adds ``--planner`` with the SLOs), replays the same arrival times and request lengths (fresh prompt
tokens per configuration, so no configuration reuses another's prefix cache), and stops the router.

Chat requests: short prompts, long outputs (decode-heavy). Document requests: long prompts, short outputs
(prefill-heavy). Each phase lasts ``--phase-s`` with Poisson arrivals at ``--rate``; the chat share is 90%, 20%, 90%.

Prints per configuration: goodput (requests meeting TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms, per second),
SLO attainment, TTFT/TPOT p90, failed requests and the planner's role switches; then the planner's goodput over the
best and the worst static split, and the planner's decision log (flips). ``--json PATH`` writes it all.

    .venv/bin/python benchmarks/planner_shift.py [--model PATH] [--phase-s 30] [--rate 6] [--slo-ttft-ms 300] \\
        [--slo-tpot-ms 30] [--worker-cpus 0,1,2,3]
    # a tiny smoke run: --phase-s 4 --rate 2 --chat-output 16 --doc-prompt 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import numpy as np
from pd.v1 import common_pb2, role_pb2, role_pb2_grpc

from splitserve.bench.client import run_requests
from splitserve.bench.metrics import SLO, summarize, summarize_by_kind
from splitserve.bench.workloads import RequestSpec
from splitserve.launcher import build_cluster, free_port
from splitserve.paths import default_model_path

ENV = {"UCX_NET_DEVICES": "lo", "PD_LOG_LEVEL": "WARNING"}
PHASES = (("chat-heavy", 0.9), ("document-heavy", 0.2), ("chat-heavy", 0.9))  # (name, share of chat requests)
STATIC = ((1, 3), (2, 2), (3, 1))
ROLE = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}


def arrivals_and_lengths(a, max_model_len: int) -> list[tuple[float, str, int, int]]:
    """(arrival s, kind, prompt tokens, output tokens) of every request: the same for every configuration."""
    rng = np.random.default_rng(a.seed)
    out, t = [], 0.0
    for p, (_, chat_share) in enumerate(PHASES):
        end = (p + 1) * a.phase_s
        while (t := t + rng.exponential(1 / a.rate)) < end:
            chat = rng.random() < chat_share
            plen, olen = (a.chat_prompt, a.chat_output) if chat else (a.doc_prompt, a.doc_output)
            plen, olen = (max(1, int(x * rng.uniform(0.75, 1.25))) for x in (plen, olen))
            olen = min(olen, max_model_len // 2)
            out.append((t, "chat" if chat else "document", max(1, min(plen, max_model_len - olen - 1)), olen))
    return out


def workload(plan: list[tuple[float, str, int, int]], seed: int) -> tuple[list[RequestSpec], list[float]]:
    rng = np.random.default_rng(seed)
    specs = [RequestSpec(i, tuple(int(x) for x in rng.integers(10, 2000, plen)), olen, kind)
             for i, (_, kind, plen, olen) in enumerate(plan)]
    return specs, [t for t, *_ in plan]


def set_roles(addresses: list[str], num_prefill: int) -> None:
    for i, address in enumerate(addresses):
        role = "prefill" if i < num_prefill else "decode"
        with grpc.insecure_channel(address) as ch:
            role_pb2_grpc.RoleServiceStub(ch).SetRole(
                role_pb2.SetRoleRequest(role=ROLE[role], drain_timeout_ms=60_000, reason="benchmark split"), timeout=90)


def start_router(a, addresses: list[str], planner: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    flags = (["--planner", "--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-itl-ms", str(a.slo_tpot_ms),
              "--planner-window-s", str(a.planner_window_s), "--planner-cooldown-s", str(a.planner_cooldown_s)]
             if planner else [])
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--model", a.model, "--http-port", str(port),
            "--grpc-port", str(free_port()), "--workers", ",".join(addresses), "--poll-interval-s", "0.5",
            "--policy", "least_loaded", *flags]
    proc = subprocess.Popen(argv, env={**os.environ, **ENV})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(base + "/v1/workers", timeout=2).json()["workers"]
            if all(w["state"] == "up" for w in workers):
                return proc, base
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("router not ready")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_config(a, name: str, addresses: list[str], num_prefill: int, planner: bool, plan, seed: int) -> dict:
    set_roles(addresses, num_prefill)
    proc, base = start_router(a, addresses, planner)
    try:
        model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
        specs, arrivals = workload(plan, seed)
        records, duration = asyncio.run(run_requests(base, model, specs, arrivals_s=arrivals, progress=False, desc=name))
        view = httpx.get(base + "/v1/workers", timeout=5).json()
    finally:
        stop(proc)
    slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
    s = summarize(records, duration, slo)
    by_kind = summarize_by_kind(records, duration, slo)
    p = view.get("planner") or {}
    flips = p.get("flip_log", [])
    return {"name": name, "goodput_rps": s["goodput_rps"], "attainment": s["slo_attainment"], "errors": s["errors"],
            "requests": s["requests"], "ttft_p90_ms": s["ttft_ms"]["p90"], "tpot_p90_ms": s["tpot_ms"]["p90"],
            "by_kind": {k: {"attainment": v["slo_attainment"], "ttft_p90_ms": v["ttft_ms"]["p90"],
                            "tpot_p90_ms": v["tpot_ms"]["p90"]} for k, v in by_kind.items()},
            "role_switches": p.get("flips", 0), "decisions": flips}


def _ratio(x: float, y: float) -> float:
    return x / y if y else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--phase-s", type=float, default=30.0, help="seconds per phase (3 phases)")
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--chat-prompt", type=int, default=64)
    ap.add_argument("--chat-output", type=int, default=128)
    ap.add_argument("--doc-prompt", type=int, default=448)
    ap.add_argument("--doc-output", type=int, default=8)
    ap.add_argument("--slo-ttft-ms", type=float, default=300.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=30.0, help="also the planner's ITL target")
    ap.add_argument("--planner-window-s", type=float, default=3.0)
    ap.add_argument("--planner-cooldown-s", type=float, default=6.0)
    ap.add_argument("--worker-cpus", default="", help="comma-separated CPU per worker (4), e.g. 0,1,2,3; empty: not pinned")
    ap.add_argument("--kv-cache-mb", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    cpus = [c for c in a.worker_cpus.split(",") if c]
    if cpus and len(cpus) != 4:
        ap.error("--worker-cpus needs 4 CPUs, one per worker")
    cluster, _, _ = build_cluster(model=a.model, num_prefill=2, num_decode=2, http_port=0, grpc_port=0, elastic=True,
                                  worker_args=["--kv-cache-mb", str(a.kv_cache_mb), "--role-switch-grace-s", "1"], env=ENV)
    cluster.children = [c for c in cluster.children if c.name != "router"]  # one router per configuration instead
    for child, cpu in zip(cluster.children, cpus):
        child.argv += ["--cpus", cpu]
    addresses = [c.health.removeprefix("grpc:") for c in cluster.children]
    cluster.start()
    results = []
    try:
        cluster.wait_healthy(timeout_s=180)
        from splitserve.model.info import load_model_info

        plan = arrivals_and_lengths(a, load_model_info(a.model).max_model_len)
        print(f"{len(plan)} requests over {3 * a.phase_s:.0f} s ({', '.join(n for n, _ in PHASES)}), 4 workers", flush=True)
        configs = [(f"static {p}P:{d}D", p, False) for p, d in STATIC] + [("planner (from 2P:2D)", 2, True)]
        for k, (name, num_prefill, planner) in enumerate(configs):
            results.append(run_config(a, name, addresses, num_prefill, planner, plan, a.seed + 1 + k))
            r = results[-1]
            print(f"  {name:22s} goodput {r['goodput_rps']:6.2f} req/s  attainment {r['attainment']:6.1%}  "
                  f"TTFT p90 {r['ttft_p90_ms'] or float('nan'):8.1f} ms  TPOT p90 {r['tpot_p90_ms'] or float('nan'):7.1f} ms  "
                  f"failed {r['errors']}  role switches {r['role_switches']}", flush=True)
    finally:
        cluster.stop()
    static = [r for r in results if r["name"].startswith("static")]
    planned = next((r for r in results if r["name"].startswith("planner")), None)
    if planned and static:
        best, worst = max(s["goodput_rps"] for s in static), min(s["goodput_rps"] for s in static)
        print(f"planner goodput / best static: {_ratio(planned['goodput_rps'], best):.2f}x; "
              f"/ worst static: {_ratio(planned['goodput_rps'], worst):.2f}x")
        for d in planned["decisions"]:
            print(f"  {d['action']} {d['time_s']:.1f} s after the router started: {d['worker']} {d['from_role']} -> {d['to_role']} ({d['reason']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
