"""Single-stream decode speed against this machine's buffer-read rate, measured in one run (prints numbers; not a test).

For each model, dtype and torch thread count: prefill a ``--prompt``-token prompt, then time ``--steps``
single-token decode steps through ``model(input_ids, positions, kv_cache, attn)`` (the engine's forward;
sampling and scheduling excluded). Reported: median decode step (wall clock; with 1 thread also the
thread's CPU time, less disturbed by other processes), tokens/s, prefill tokens/s, the bytes one step must
read (every weight but the embedding table, plus the KV context) and the fraction of the rate at which
``torch.sum`` reads a buffer of that many bytes in the same process (``read fraction``; 1.0 = decode moves
weights as fast as the machine reads a buffer of their size; weights that fit in L3 read faster than DRAM).

``--runner-batches 1,16`` instead times whole engine decode steps of that many sequences through
``ModelRunner.execute`` (step inputs, forward, greedy sampling; no scheduler), reported as tokens/s.

Before/after comparisons: run the same command with ``PYTHONPATH=<another checkout>`` (the script uses only
the public ``load_model`` / ``AttentionMetadata`` / ``ModelRunner`` / ``Sequence`` API). Numbers from a shared machine are noisy: compare
ratios from one run, and re-measure on a quiet machine.

    .venv/bin/python benchmarks/engine_decode.py [--models synthetic:llama-25m,models/TinyStories-656K]
        [--dtypes float32,bfloat16] [--threads 1,2] [--prompt 128] [--steps 64] [--runner-batches 1,16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from splitserve.model import AttentionMetadata, load_model

BS = 16


def read_rate(nbytes: int, repeat: int = 20) -> float:
    """Bytes/s at which ``torch.sum`` reads a float32 buffer of ``nbytes`` (best of ``repeat``, after a warm-up)."""
    buf = torch.ones(max(nbytes // 4, 1))
    buf.sum()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def step_bytes(lm, context: int) -> int:
    """Bytes one decode step reads: all weights except the embedding table, plus the K/V of ``context`` tokens."""
    emb = lm.model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters() if p is not emb)
    c = lm.config
    return weights + context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * emb.element_size()


def decode_run(lm, prompt: int, steps: int) -> dict:
    """Prefill ``prompt`` tokens, then ``steps`` decode steps; timings of both."""
    nblk = -(-(prompt + steps + 1) // BS)
    cache = lm.model.allocate_kv_cache(nblk, BS)
    table = list(range(nblk))

    def run(ids: list[int], start: int) -> torch.Tensor:
        n = len(ids)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(start, start + n)])
        meta = AttentionMetadata(slots, [n], [start + n], [table], BS)
        with torch.inference_mode():
            return lm.model(torch.tensor(ids), torch.arange(start, start + n), cache, meta)

    ids = [(17 * i) % 500 + 3 for i in range(prompt)]
    run(ids, 0)  # warm-up
    prefill_s = float("inf")
    for _ in range(3):  # best of 3 (the prompt's K/V is rewritten in place each time)
        t = time.perf_counter()
        tok = int(run(ids, 0)[0].argmax())
        prefill_s = min(prefill_s, time.perf_counter() - t)
    wall, cpu = [], []
    for i in range(steps):
        w, c = time.perf_counter(), time.thread_time()
        tok = int(run([tok], prompt + i)[0].argmax())
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    return {"prefill_tok_s": prompt / prefill_s, "step_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "context": prompt + steps // 2}


def runner_run(lm, batch: int, prompt: int, steps: int, threads: int) -> tuple[float, float]:
    """Median (wall, this thread's CPU) seconds of one ``ModelRunner.execute`` decode step of ``batch``
    sequences (after their prefill)."""
    from splitserve.engine.runner import ModelRunner
    from splitserve.engine.sampling import SamplingParams
    from splitserve.engine.sequence import Sequence

    per_seq = -(-(prompt + steps + 2) // BS)
    runner = ModelRunner(lm, lm.model.allocate_kv_cache(batch * per_seq, BS), BS, threads)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0)
    seqs = [Sequence(f"r{i}", [(17 * j + i) % 500 + 3 for j in range(prompt)], params,
                     block_table=list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]

    def step(group: list) -> None:
        for seq, tok in zip(group, runner.execute(group)):
            seq.num_computed_tokens += seq.num_step_tokens
            seq.output_token_ids.append(tok)

    for seq in seqs:
        step([seq])
    wall, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        step(seqs)
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="synthetic:llama-25m,models/TinyStories-656K")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runner-batches", default="", help="time ModelRunner.execute decode steps of these batch sizes")
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    if a.runner_batches:
        print("| model | dtype | threads | batch | runner step ms (wall) | step ms (CPU, 1 thread) | output tok/s |")
        print("|---|---|---|---|---|---|---|")
        for model in a.models.split(","):
            for dtype in a.dtypes.split(","):
                lm = load_model(model, dtype=dtype)
                for threads in (int(x) for x in a.threads.split(",")):
                    torch.set_num_threads(threads)
                    for batch in (int(x) for x in a.runner_batches.split(",")):
                        t, c = runner_run(lm, batch, a.prompt, a.steps, threads)
                        cpu = f"{c * 1e3:.2f}" if threads == 1 else "-"
                        print(f"| {model} | {dtype} | {threads} | {batch} | {t * 1e3:.2f} | {cpu} | {batch / t:.0f} |", flush=True)
        return
    print("| model | dtype | threads | decode tok/s | step ms (wall) | step ms (CPU, 1 thread) | step MB | buffer read GB/s "
          "| read fraction | prefill tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for dtype in a.dtypes.split(","):
            lm = load_model(model, dtype=dtype)
            for threads in (int(x) for x in a.threads.split(",")):
                torch.set_num_threads(threads)
                r = decode_run(lm, a.prompt, a.steps)
                nbytes = step_bytes(lm, r["context"])
                rate = read_rate(nbytes)
                cpu = f"{r['cpu_s'] * 1e3:.2f}" if threads == 1 else "-"
                print(f"| {model} | {dtype} | {threads} | {1 / r['step_s']:.0f} | {r['step_s'] * 1e3:.2f} | {cpu} | {nbytes / 1e6:.1f} | "
                      f"{rate / 1e9:.1f} | {nbytes / r['step_s'] / rate:.2f} | {r['prefill_tok_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
