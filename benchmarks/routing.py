"""Routing benchmark: policies and conditional disaggregation on 2 prefill + 2 decode workers.

Starts one cluster (2 prefill + 2 decode workers + KV store, real processes), then one router process
per configuration over the same workers, and sends each the same workload:

1. Policies (round_robin, least_loaded, prefix_aware): requests sharing a few long prefixes plus
   unrelated prompts, closed loop. Prints TTFT p50/p99, cached-token share and per-worker picks.
2. Mixed short/long: short prompts interleaved with long ones. Prints TTFT p50 of the short prompts
   with ``--disagg always`` (every prompt remote), a fixed threshold, ``auto``, and a colocated server
   (the target: conditional disaggregation within 10% of colocated for short prompts).

    .venv/bin/python benchmarks/routing.py [--model synthetic:llama-25m] [--requests 48] [--concurrency 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import httpx

from splitserve.bench.client import run_requests
from splitserve.bench.workloads import RequestSpec
from splitserve.launcher import build_cluster, free_port

ENV = {"UCX_NET_DEVICES": "lo", "PD_LOG_LEVEL": "WARNING"}


def _wait(base: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(base + "/v1/workers", timeout=2)
            if r.status_code == 200 and all(w["state"] == "up" for w in r.json()["workers"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{base} not ready")


def start_router(model: str, prefill: str, decode: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "router", "--model", model, "--http-port", str(port),
            "--grpc-port", str(free_port()), "--prefill", prefill, "--decode", decode, "--poll-interval-s", "0.3", *flags]
    proc = subprocess.Popen(argv, env={**os.environ, **ENV})
    base = f"http://127.0.0.1:{port}"
    _wait(base)
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def policy_workload(n: int, seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    prefixes = [prompt(rng, 1024) for _ in range(4)]
    specs = []
    for i in range(n):
        if i % 4 == 3:
            p = prompt(rng, rng.randrange(200, 800))  # unrelated
        else:
            p = rng.choice(prefixes) + prompt(rng, rng.randrange(16, 64))
        specs.append(RequestSpec(index=i, prompt_token_ids=p, max_tokens=16, kind="shared" if i % 4 != 3 else "unrelated"))
    return specs


def mixed_workload(n: int, short: int, long: int, seed: int = 1) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(index=i, prompt_token_ids=prompt(rng, long if i % 3 == 2 else short), max_tokens=16,
                        kind="long" if i % 3 == 2 else "short") for i in range(n)]


async def run(base: str, specs: list[RequestSpec], concurrency: int):
    model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    warm = [RequestSpec(index=i, prompt_token_ids=s.prompt_token_ids[:32] + [7, 8, 9, i], max_tokens=4, kind="warm")
            for i, s in enumerate(specs[:4])]
    await run_requests(base, model, warm, concurrency=2, progress=False)
    before = picks(base)
    records, _ = await run_requests(base, model, specs, concurrency=concurrency, progress=False)
    return records, before


async def run_colocated(base: str, specs: list[RequestSpec], concurrency: int):
    model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    return (await run_requests(base, model, specs, concurrency=concurrency, progress=False))[0], None


def picks(base: str) -> dict[str, int]:
    return {f"{w['role']}@{w['address']}": w["picks"] for w in httpx.get(base + "/v1/workers", timeout=5).json()["workers"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:llama-25m")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--short", type=int, default=32, help="short prompt tokens (mixed workload)")
    ap.add_argument("--long", type=int, default=1536, help="long prompt tokens (mixed workload)")
    ap.add_argument("--threshold", type=int, default=256, help="fixed conditional-disaggregation threshold")
    a = ap.parse_args()

    cluster, _, _ = build_cluster(model=a.model, num_prefill=2, num_decode=2, http_port=0, grpc_port=0,
                                  worker_args=["--kv-cache-mb", "256"], env=ENV, store_nodes=1, node_args=["--segment-mb", "256"])
    cluster.children = [c for c in cluster.children if c.name != "router"]  # one router per configuration below
    cluster.start()
    try:
        cluster.wait_healthy(timeout_s=180)
        addr = {c.name: c.health.removeprefix("grpc:") for c in cluster.children}
        prefill, decode = f"{addr['prefill-0']},{addr['prefill-1']}", f"{addr['decode-0']},{addr['decode-1']}"
        print(f"model {a.model}; 2 prefill + 2 decode workers; {a.requests} requests, concurrency {a.concurrency}\n")
        print("== policies (shared 1024-token prefixes x4 + 25% unrelated prompts; 16 output tokens) ==")
        print(f"{'policy':<14}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'cached %':>10}{'errors':>8}   picks per worker")
        for k, policy in enumerate(("round_robin", "least_loaded", "prefix_aware")):
            proc, base = start_router(a.model, prefill, decode, "--policy", policy)
            try:
                # same shape, fresh tokens per policy: the KV store is shared, so no policy starts warm from another's run
                recs, before = asyncio.run(run(base, policy_workload(a.requests, seed=10 + k), a.concurrency))
                after = picks(base)
            finally:
                stop(proc)
            ttft = [r.ttft_s * 1e3 for r in recs if r.ok]
            cached = sum(r.cached_tokens for r in recs) / max(sum(r.prompt_tokens for r in recs), 1) * 100
            load = " ".join(f"{k.split('@')[0][0]}{k.rsplit(':', 1)[1]}={after[k] - before[k]}" for k in sorted(after))
            print(f"{policy:<14}{pct(ttft, 50):>12.1f}{pct(ttft, 99):>12.1f}{cached:>10.1f}{sum(not r.ok for r in recs):>8}   {load}")

        print(f"\n== mixed: 2/3 short ({a.short} tokens), 1/3 long ({a.long} tokens); TTFT of short prompts ==")
        mixed = mixed_workload(a.requests, a.short, a.long)
        results = {}
        for label, flags in (("always remote", ["--disagg", "always"]), (f"threshold {a.threshold}", ["--disagg", str(a.threshold)]),
                             ("auto", ["--disagg", "auto"])):
            proc, base = start_router(a.model, prefill, decode, "--policy", "least_loaded", *flags)
            try:
                recs, _ = asyncio.run(run(base, mixed, a.concurrency))
                view = httpx.get(base + "/v1/workers", timeout=5).json()["disaggregation"]
            finally:
                stop(proc)
            results[label] = recs
            extra = f" (auto threshold now {view['threshold_tokens']:.0f} tokens)" if label == "auto" else ""
            short = [r.ttft_s * 1e3 for r in recs if r.ok and r.kind == "short"]
            print(f"{label:<16} short TTFT p50 {pct(short, 50):8.1f} ms  p99 {pct(short, 99):8.1f} ms  errors {sum(not r.ok for r in recs)}{extra}")
    finally:
        cluster.stop()

    port = free_port()
    colo = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "colocated", "--model", a.model, "--http-port", str(port),
                             "--grpc-port", str(free_port()), "--kv-cache-mb", "256"], env={**os.environ, **ENV})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("colocated server not ready")
            time.sleep(0.3)
        recs, _ = asyncio.run(run_colocated(base, mixed, a.concurrency))
    finally:
        stop(colo)
    short = [r.ttft_s * 1e3 for r in recs if r.ok and r.kind == "short"]
    colo_p50 = pct(short, 50)
    print(f"{'colocated':<16} short TTFT p50 {colo_p50:8.1f} ms  p99 {pct(short, 99):8.1f} ms  (one process, no KV transfer)")
    for label, recs in results.items():
        p50 = pct([r.ttft_s * 1e3 for r in recs if r.ok and r.kind == "short"], 50)
        print(f"  {label:<16} short TTFT p50 / colocated = {p50 / colo_p50:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
