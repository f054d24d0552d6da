"""Engine decode step time (ModelRunner.execute: step inputs, forward, greedy sampling) per batch size, against the
device's memory-bandwidth bound (weight bytes + KV bytes read per step / bandwidth). Prints numbers; not a test.

    .venv/bin/python benchmarks/engine_decode_step.py [--model synthetic:llama-25m] [--device cpu|cuda]
        [--dtype float32] [--batches 1,16,64] [--context 256] [--steps 20] [--enforce-eager]
        [--threads 1]  [--bandwidth-gbps 4800]   # default: PD_GPU_BANDWIDTH_GBPS, else 4800 (H200 HBM3e) on cuda, memcpy on cpu

On the CPU, float32 runs on splitserve's CPU kernels unless ``PD_CPU_KERNELS=0`` (torch.mm and SDPA): run both
for an A/B. On cuda the runner replays CUDA graphs (captured once per bucket before timing) unless ``--enforce-eager``.
Also runs on a tree without ``--device`` support (cpu only), so a before/after pair can run in one session.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

import torch

from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.model import load_model

BS = 16


def _load(model: str, dtype: str, device: str):
    if "device" in inspect.signature(load_model).parameters:
        return load_model(model, dtype=dtype, device=device)
    if device != "cpu":
        raise SystemExit("this tree has no --device support")
    return load_model(model, dtype=dtype)


def _runner(lm, batch: int, context: int, steps: int, device: str, eager: bool):
    """A runner over a fresh cache holding ``batch`` sequences of ``context`` tokens (prefilled) with room for
    ``steps`` more; returns (runner, sequences)."""
    per_seq = -(-(context + steps + 2) // BS)
    blocks = batch * per_seq
    graphs = None
    if device != "cpu" and not eager:
        from splitserve.engine.cuda_graphs import CudaGraphDecoder

        cache = lm.model.allocate_kv_cache(blocks + 1, BS)
        graphs = CudaGraphDecoder(lm.model, cache, BS, batch, per_seq * BS, scratch_block=blocks)
    else:
        cache = lm.model.allocate_kv_cache(blocks, BS)
    kwargs = {"graphs": graphs} if "graphs" in inspect.signature(ModelRunner).parameters else {}
    runner = ModelRunner(lm, cache, BS, 0, **kwargs)  # every step on the torch threads set in main (--threads)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(context)], params,
                     block_table=list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
    for s in seqs:  # prefill one at a time (a [context] forward each)
        s.output_token_ids.append(runner.execute([s])[0])
        s.num_computed_tokens = context
    return runner, seqs


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def decode_ms(lm, batch: int, context: int, steps: int, device: str, eager: bool) -> tuple[float, float]:
    """(median, min) ms of one decode step of ``batch`` sequences at ``context`` tokens (``steps`` timed steps; the
    minimum is the one to compare on a loaded machine: other processes only ever add time)."""
    runner, seqs = _runner(lm, batch, context, steps, device, eager)
    times = []
    for k in range(steps + 2):  # 2 warm-up steps (first one captures the graph)
        _sync(device)
        t = time.perf_counter()
        tokens = runner.execute(seqs)
        _sync(device)
        if k >= 2:
            times.append(time.perf_counter() - t)
        for s, tok in zip(seqs, tokens):
            s.num_computed_tokens += 1
            s.output_token_ids.append(tok)
    return statistics.median(times) * 1e3, min(times) * 1e3


def step_bytes(lm, batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table, plus each sequence's KV."""
    c, m = lm.config, lm.model
    emb = m.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in m.parameters() if p is not emb)
    return weights + batch * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * emb.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:llama-25m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every step (cpu)")
    ap.add_argument("--bandwidth-gbps", type=float, default=float(os.environ.get("PD_GPU_BANDWIDTH_GBPS", 0) or 0),
                    help="memory bandwidth for the bound, GB/s (0: 4800 on cuda, a measured memcpy on cpu)")
    ap.add_argument("--json", action="store_true", help="one JSON line per batch size")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = _load(a.model, a.dtype, a.device)
    bw = a.bandwidth_gbps or (4800.0 if a.device != "cpu" else 0.0)
    if not bw:
        from splitserve.bench.efficiency import memcpy_bandwidth

        bw = memcpy_bandwidth() / 1e9
    mode = "eager" if a.enforce_eager or a.device == "cpu" else "cuda graphs"
    if not a.json:
        kernels = "splitserve CPU kernels" if getattr(lm.model, "packed_for_cpu", False) else "torch"
        print(f"{a.model} {a.dtype} on {a.device} ({mode}, {kernels}, {a.threads} threads), context {a.context}, "
              f"bound at {bw:.0f} GB/s")
        print("| batch | step ms (median) | min | bound ms | step / bound | tokens/s |\n|---|---|---|---|---|---|")
    for b in (int(x) for x in a.batches.split(",")):
        ms, best = decode_ms(lm, b, a.context, a.steps, a.device, a.enforce_eager)
        bound = step_bytes(lm, b, a.context) / (bw * 1e9) * 1e3
        row = {"batch": b, "step_ms": round(ms, 3), "min_ms": round(best, 3), "bound_ms": round(bound, 4), "ratio": round(ms / bound, 2),
               "tokens_per_s": round(b / ms * 1e3, 1), "device": a.device, "mode": mode, "dtype": a.dtype}
        print(json.dumps(row) if a.json else f"| {b} | {ms:.3f} | {best:.3f} | {bound:.4f} | {ms / bound:.1f}x | {b / ms * 1e3:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
