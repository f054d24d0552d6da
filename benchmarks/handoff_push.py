"""The prefill -> decode handoff as a user sees it: KV push (per layer, and whole KV) vs direct pull vs colocated.

Starts, on this machine's cores and at the same time, four deployments of the same model as real processes
(gRPC control, UCX data, no KV store): ``push`` (router and workers ``--kv-transfer-mode push``, one message per
layer and block: the send of layer i overlaps the compute of layer i+1), ``push-whole`` (the same with
``--kv-push-layer-groups 1``: the whole KV is pushed after the prefill, increment 1 of the design), ``direct``
(the decode worker pulls after the prefill answered) and ``colocated`` (one engine, no handoff). Then it sends
greedy requests one at a time, rotating over the deployments request by request (A B C D A B C D ...) so that a
load change on a shared machine hits all of them, and timestamps the streamed tokens on the client:

* TTFT: send -> first token;  handoff gap: first token -> second token (the cost of the handoff between the
  prefill worker's first token and the decode worker's first step; in colocated mode one decode step).

Prints p50/p90 per deployment for a short and a long prompt, the push/direct ratios (target: push gap p50 <=
0.77x direct's), and a prompt-length sweep (where the per-layer overlap starts to pay beside the fixed cost of a
handoff). Prompts are random token ids (unique: no prefix reuse). Checks that every deployment produced the same
greedy tokens for a prompt. Prints numbers; asserts nothing else.

    .venv/bin/python -u benchmarks/handoff_push.py [--model synthetic:llama-25m] [--requests 30] [--sweep-requests 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

import grpc
import httpx
from pd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from splitserve.client import RouterClient
from splitserve.launcher import build_cluster, free_port

ENV = {"UCX_NET_DEVICES": "lo", "PD_LOG_LEVEL": "WARNING"}


class Colocated:
    def __init__(self, model: str, args: list[str]) -> None:
        http, self.grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "splitserve.cli", "colocated", "--model", model, "--http-port", str(http),
                "--grpc-port", str(self.grpc_port), *args]
        self.proc = subprocess.Popen(argv, env={**os.environ, **ENV})
        self.url = f"http://127.0.0.1:{http}/health"

    def wait(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("colocated server exited")
            try:
                if httpx.get(self.url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("colocated server not healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def one(address: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT s, handoff gap s, tokens) of one greedy request."""
    times, tokens = [], []
    async with RouterClient(address) as client:
        t0 = time.perf_counter()
        async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120):
            for tok in r.token_ids:
                times.append(time.perf_counter())
                tokens.append(tok)
    return times[0] - t0, times[1] - times[0], tokens


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] * 1000


async def measure(deps: dict[str, str], lengths: list[int], requests: int, max_tokens: int, rng: random.Random,
                  vocab: int) -> dict[tuple[str, int], list[tuple[float, float]]]:
    out: dict[tuple[str, int], list[tuple[float, float]]] = {(d, n): [] for d in deps for n in lengths}
    mismatches = 0
    for i in range(requests):
        for n in lengths:
            prompt = [rng.randrange(10, vocab - 10) for _ in range(n)]
            names = list(deps)
            names = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
            seen = {}
            for d in names:
                ttft, gap, toks = await one(deps[d], prompt, max_tokens)
                out[(d, n)].append((ttft, gap))
                seen[d] = toks
            mismatches += len({tuple(t) for t in seen.values()}) > 1
    if mismatches:
        print(f"WARNING: {mismatches} prompts produced different greedy tokens across deployments")
    return out


def report(title: str, res, deps: list[str], lengths: list[int]) -> None:
    print(f"\n## {title}")
    print(f"{'prompt':>7} {'deployment':>11} {'n':>3} | {'TTFT p50':>9} {'p90':>8} | {'gap p50':>8} {'p90':>8} | "
          f"{'gap/direct':>10} {'TTFT/direct':>11}")
    for n in lengths:
        base = res[("direct", n)]
        bg, bt = statistics.median(g for _t, g in base), statistics.median(t for t, _g in base)
        for d in deps:
            xs = res[(d, n)]
            ttft, gap = [t for t, _g in xs], [g for _t, g in xs]
            print(f"{n:>7} {d:>11} {len(xs):>3} | {pct(ttft, .5):>9.1f} {pct(ttft, .9):>8.1f} | {pct(gap, .5):>8.2f} "
                  f"{pct(gap, .9):>8.2f} | {statistics.median(gap) / bg:>10.2f} {statistics.median(ttft) / bt:>11.2f}")


async def counters(cluster) -> str:
    """What the workers of one deployment did (pushed / pulled / recomputed), to check the runs took their path."""
    out = {}
    for child in cluster.children:
        if child.name not in ("prefill-0", "decode-0"):
            continue
        stub = prefill_pb2_grpc.PrefillServiceStub if child.name.startswith("prefill") else decode_pb2_grpc.DecodeServiceStub
        async with grpc.aio.insecure_channel(child.health.removeprefix("grpc:")) as ch:
            c = dict((await stub(ch).GetStats(common_pb2.GetStatsRequest(), timeout=10)).counters)
        keys = (("requests", "kv_pushes", "kv_push_fallbacks") if child.name.startswith("prefill")
                else ("requests", "kv_pushes_received", "kv_transfers_ok", "local_prefills", "kv_transfer_fallbacks"))
        out[child.name] = {k: int(c.get(k, 0)) for k in keys}
    return str(out)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:llama-25m")
    ap.add_argument("--short", type=int, default=32, help="short prompt (tokens)")
    ap.add_argument("--long", type=int, default=1024, help="long prompt (tokens)")
    ap.add_argument("--sweep", default="16,64,256,512,1024,2000", help="prompt lengths of the sweep (tokens)")
    ap.add_argument("--requests", type=int, default=30, help="requests per deployment for short and long")
    ap.add_argument("--sweep-requests", type=int, default=8, help="requests per deployment and sweep length")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    worker = ["--kv-cache-mb", str(a.kv_cache_mb), "--max-num-batched-tokens", "4096"]
    specs = {
        "push": (["--kv-transfer-mode", "push"], {}),
        "push-whole": (["--kv-transfer-mode", "push"], {"decode": ["--kv-push-layer-groups", "1"]}),
        "direct": (["--kv-transfer-mode", "direct"], {}),
    }
    clusters, deps = [], {}
    for name, (mode, role_args) in specs.items():
        # a prefill worker busy with a long prompt may miss heartbeats on a loaded machine: never take it out of
        # rotation here (the request would be prefilled on the decode worker instead, a different path)
        c, _http, grpc_port = build_cluster(model=a.model, http_port=0, grpc_port=0, worker_args=[*worker, *mode],
                                            env=ENV, router_args=[*mode, "--miss-limit", "1000000"], role_args=role_args)
        clusters.append(c)
        deps[name] = f"127.0.0.1:{grpc_port}"
    colo = Colocated(a.model, worker)
    deps["colocated"] = f"127.0.0.1:{colo.grpc_port}"
    try:
        for c in clusters:
            c.start()
        for c in clusters:
            c.wait_healthy(timeout_s=300)
        colo.wait()
        await asyncio.sleep(3)  # the routers' first polls (a push router needs the prefill workers' KV endpoints)
        from splitserve.model import load_model

        vocab = load_model(a.model).config.vocab_size
        rng = random.Random(a.seed)
        print(f"model {a.model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
              f"max_tokens {a.max_tokens}; gap = second token - first token (ms)")
        await measure(deps, [a.short, a.long], a.warmup, a.max_tokens, rng, vocab)
        main_res = await measure(deps, [a.short, a.long], a.requests, a.max_tokens, rng, vocab)
        report("short and long prompts", main_res, list(deps), [a.short, a.long])
        sweep = [int(x) for x in a.sweep.split(",")]
        sweep_res = await measure(deps, sweep, a.sweep_requests, a.max_tokens, rng, vocab)
        report("prompt-length sweep", sweep_res, list(deps), sweep)
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
        for name, c in zip(specs, clusters):
            print(f"{name}: {await counters(c)}")
    finally:
        colo.stop()
        for c in clusters:
            c.stop()


if __name__ == "__main__":
    asyncio.run(main())
