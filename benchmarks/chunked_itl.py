"""Colocated unchunked vs chunked prefill (Sarathi-style) under a mixed load, alternating A B A B in one run.

Drives ``AsyncEngine`` directly in this process (no HTTP server, no router: the same engine, scheduler and
runner ``splitserve colocated`` uses, without the HTTP front door competing for the two cores). One
closed-loop client keeps ``--concurrency`` requests in flight; every ``--document-every``-th request after the
first ``--warm`` is a ~1,000-token document, the others ~130-token chat prompts; every request asks for
``--output`` +- ``--output-spread`` tokens (greedy, ignore_eos; the spread keeps a closed loop from moving in
lockstep waves). The client timestamps every streamed token on the event loop: the
first gives TTFT, the gaps between consecutive ones the ITLs; ``splitserve.bench.metrics.summarize`` computes
the percentiles, as for ``splitserve bench``.

Configurations run alternately (``--rounds`` times unchunked then chunked) with a fresh engine each, so a
load change on a shared machine hits both; ratios are printed within each round only. Each run also checks
that chunked produced the same greedy tokens as unchunked (it must). Prints numbers; asserts nothing else.

    .venv/bin/python benchmarks/chunked_itl.py [--budget 256] [--rounds 2] [--requests 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import torch

from splitserve.bench import workloads as wl
from splitserve.bench.client import RequestRecord
from splitserve.bench.metrics import summarize
from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.model import load_model


async def run_config(lm, cfg: EngineConfig, specs: list[wl.RequestSpec], concurrency: int) -> tuple[dict, dict[int, list[int]], dict]:
    """One closed-loop run on a fresh engine; returns (summary, tokens by request index, engine stats)."""
    engine = AsyncEngine(lm, cfg)
    await engine.start()
    try:
        warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for i, spec in enumerate(specs[:2]):  # first calls of each kernel shape, untimed
            async for _ in engine.generate(f"warm{i}", list(spec.prompt_token_ids[:64]), warm):
                pass
        records: list[RequestRecord] = []
        tokens: dict[int, list[int]] = {}
        queue = list(specs)
        t0 = time.perf_counter()

        async def one(spec: wl.RequestSpec) -> None:
            rec = RequestRecord(spec.index, spec.kind, spec.max_tokens, start_s=time.perf_counter() - t0,
                                prompt_tokens=len(spec.prompt_token_ids))
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0, ignore_eos=True)
            sent = last = time.perf_counter()
            out_ids: list[int] = []
            async for out in engine.generate(f"r{spec.index}", list(spec.prompt_token_ids), params):
                now = time.perf_counter()
                for _ in out.token_ids:
                    if rec.ttft_s is None:
                        rec.ttft_s = now - sent
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.chunks += 1
                out_ids += out.token_ids
            rec.e2e_s = time.perf_counter() - sent
            rec.output_tokens = len(out_ids)
            tokens[spec.index] = out_ids
            records.append(rec)

        async def worker() -> None:
            while queue:
                await one(queue.pop(0))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
        return summarize(records, duration), tokens, await engine.stats()
    finally:
        await engine.stop()


def row(name: str, s: dict, stats: dict) -> str:
    itl, ttft = s["itl_ms"], s["ttft_ms"]
    return (f"| {name} | {s['output_tokens_per_s']:.1f} | {ttft['p50']:.0f} | {itl['p50']:.1f} | {itl['p90']:.1f} | "
            f"{itl['p99']:.1f} | {itl['max']:.0f} | {stats['engine_steps']} | {s['duration_s']:.1f} | {os.getloadavg()[0]:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama-25m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget", type=int, default=0, help="chunked token budget per step (0: the engine's default)")
    ap.add_argument("--rounds", type=int, default=2, help="unchunked, chunked pairs (A B A B ...)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--document-every", type=int, default=4)
    ap.add_argument("--warm", type=int, default=4, help="interactive requests before the first document")
    ap.add_argument("--output", type=int, default=128, help="mean output tokens of a request")
    ap.add_argument("--output-spread", type=int, default=32,
                    help="output lengths uniform in output +- spread (0: all equal; then a closed loop moves in waves: "
                         "every request finishes in the same step and the next ones all arrive together)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of prefill and mixed steps")
    ap.add_argument("--decode-threads", type=int, default=1, help="torch threads of small decode-only steps")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, dtype=a.dtype)
    vocab = list(range(3, lm.config.vocab_size))
    specs = wl.synthetic_mixed(vocab, a.requests, a.seed, document_every=a.document_every, warm_interactive=a.warm,
                               interactive_prompt=(120, 140), interactive_output=(a.output - a.output_spread, a.output + a.output_spread),
                               document_prompt=(960, 1040), document_output=(a.output - a.output_spread, a.output + a.output_spread)).requests
    unchunked = EngineConfig(kv_cache_mb=512, dtype=a.dtype, decode_threads=a.decode_threads)
    chunked = EngineConfig(kv_cache_mb=512, dtype=a.dtype, decode_threads=a.decode_threads, enable_chunked_prefill=True,
                           max_num_batched_tokens=a.budget)
    print(f"{a.model} {a.dtype}, {a.requests} requests at concurrency {a.concurrency}, every {a.document_every}th a "
          f"~1,000-token document (960-1040), others 120-140 tokens, "
          f"{a.output - a.output_spread}-{a.output + a.output_spread} output tokens; threads "
          f"{a.threads} (decode-only steps {a.decode_threads}); chunked budget {chunked.token_budget(lm.max_model_len)} "
          f"tokens/step; load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| run | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | ITL max ms | steps | duration s | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for r in range(a.rounds):
        su, tu, stu = asyncio.run(run_config(lm, unchunked, specs, a.concurrency))
        print(row(f"{r + 1}A unchunked", su, stu), flush=True)
        sc, tc, stc = asyncio.run(run_config(lm, chunked, specs, a.concurrency))
        print(row(f"{r + 1}B chunked", sc, stc), flush=True)
        if tc != tu:
            print(f"  !! round {r + 1}: chunked tokens differ from unchunked for requests "
                  f"{sorted(i for i in tu if tu[i] != tc.get(i))[:10]}")
        ratios.append((sc["output_tokens_per_s"] / su["output_tokens_per_s"], sc["ttft_ms"]["p50"] / su["ttft_ms"]["p50"],
                       *(sc["itl_ms"][p] / su["itl_ms"][p] for p in ("p50", "p90", "p99"))))
    print("\nchunked / unchunked, within each round (target: ITL p90 < 1, ITL p99 < 1, throughput 0.95-1.05)")
    print("| round | output tok/s | TTFT p50 | ITL p50 | ITL p90 | ITL p99 |")
    print("|---|---|---|---|---|---|")
    for r, q in enumerate(ratios):
        print(f"| {r + 1} | " + " | ".join(f"{x:.2f}" for x in q) + " |")


if __name__ == "__main__":
    main()
