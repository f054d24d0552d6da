"""Engine efficiency against this CPU's own limits, measured in one run.

* memcpy bandwidth: a 256 MiB tensor copy; bytes read + bytes written per second.
* read bandwidth: a sum over a buffer of the decode step's size (weights + KV), bytes read per second: the
  rate the decode step could read its bytes at (issue 13's bound; such a buffer may sit in the cache, as the
  weights do).
* matmul peak: torch's ``[2048, 2048] @ [2048, 2048]`` GFLOP/s in the model's dtype (the better of ``a @ b`` and
  ``F.linear(a, b)``: torch's 16-bit CPU GEMMs differ by operand layout), and in float32. On a CPU without
  bf16/fp16 arithmetic (AVX2) torch's 16-bit GEMM is emulated and far below float32's, and splitserve's kernels
  compute 16-bit models in float32: prefill is then reported against both.
* decode step: one forward of ``batch`` sequences at context ``context`` through the engine's model
  code; its memory-bandwidth bound is (weight bytes + KV bytes read) / memcpy bandwidth.
* prefill: tokens/s of one ``prompt``-token prompt, and the GFLOP/s that implies (2 FLOPs per
  weight per token + causal attention) against the matmul peak.

Each is measured with 1 and with 2 torch threads (a disaggregated worker has one core, the
colocated server both).
"""

from __future__ import annotations

import gc
import time

import torch

from splitserve.model import AttentionMetadata, LoadedModel

MiB = 2**20


def _best(fn, repeat: int, device: torch.device | str = "cpu") -> float:
    """Shortest wall time of ``fn()`` in seconds (a GPU's queued kernels waited for inside each timing)."""
    wait = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()  # warm-up
    wait()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        wait()
        best = min(best, time.perf_counter() - t)
    return best


def memcpy_bandwidth(nbytes: int = 256 * MiB, repeat: int = 5, device: str = "cpu") -> float:
    """Bytes/s moved (read + write) by a large tensor copy on ``device``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeat, device)


def read_bandwidth(nbytes: int, repeat: int = 5, device: str = "cpu") -> float:
    """Bytes/s read by a sum over an ``nbytes`` float32 buffer on ``device`` (read once; the sum's FLOPs are cheap)."""
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    return src.numel() * 4 / _best(lambda: src.sum(), repeat, device)


def matmul_peak(n: int = 2048, repeat: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32,
                budget_s: float = 10.0) -> float:
    """FLOP/s of an n×n matmul in ``dtype`` on ``device``: the better of ``a @ b`` and ``F.linear(a, b)`` (``b``
    as a Linear's ``[out, in]`` weight). Both are first timed at n / 4; if the faster one's rate would take more
    than ``budget_s`` for ``repeat + 1`` calls at n (torch's emulated 16-bit GEMMs on an AVX2 CPU: ~1 minute per
    call at 2048), that rate is the answer."""
    def rate(size: int, layout: int, times: int) -> float:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        call = (lambda: a @ b) if layout == 0 else (lambda: torch.nn.functional.linear(a, b))
        return 2 * size**3 / _best(call, times, device)

    small = [rate(n // 4, layout, 2) for layout in (0, 1)]
    layout = max((0, 1), key=small.__getitem__)
    if (repeat + 1) * 2 * n**3 / small[layout] > budget_s:
        return small[layout]
    return max(small[layout], rate(n, layout, repeat))


def _weight_bytes(lm: LoadedModel) -> int:
    """Bytes a decode step reads: every weight except the embedding table (only a few rows are read), with the
    lm_head counted as the copy the step multiplies by (its CPU kernels' panels when packed)."""
    m = lm.model
    emb, head, head_panels = m.model.embed_tokens.weight, m.lm_head.weight, m.lm_head_packed
    body = sum(p.numel() * p.element_size() for p in m.parameters() if p is not emb and p is not head)
    read_head = head if head_panels is None else head_panels
    return body + read_head.numel() * read_head.element_size()


def decode_step(lm: LoadedModel, batch: int = 8, context: int = 512, block_size: int = 16, repeat: int = 10) -> tuple[float, int]:
    """(seconds per decode step, bytes it must read) for ``batch`` sequences at ``context`` tokens."""
    c = lm.config
    per_seq = -(-(context + 1) // block_size)
    cache = lm.model.allocate_kv_cache(batch * per_seq, block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    slots = torch.tensor([t[context // block_size] * block_size + context % block_size for t in tables])
    attn = AttentionMetadata(slots, [1] * batch, [context + 1] * batch, tables, block_size)
    ids, pos = torch.full((batch,), 100), torch.full((batch,), context)
    with torch.inference_mode():
        step = _best(lambda: lm.model(ids, pos, cache, attn), repeat, cache.device)
    kv_bytes = batch * (context + 1) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * cache.element_size()
    return step, _weight_bytes(lm) + kv_bytes


def prefill(lm: LoadedModel, prompt: int = 512, block_size: int = 16, repeat: int = 3) -> tuple[float, float]:
    """(tokens/s, FLOPs) of prefilling one ``prompt``-token prompt."""
    c = lm.config
    nblk = -(-prompt // block_size)
    cache = lm.model.allocate_kv_cache(nblk, block_size)
    table = list(range(nblk))
    attn = AttentionMetadata(torch.arange(prompt), [prompt], [prompt], [table], block_size)
    ids, pos = torch.full((prompt,), 100), torch.arange(prompt)
    with torch.inference_mode():
        t = _best(lambda: lm.model(ids, pos, cache, attn), repeat, cache.device)
    emb = lm.model.model.embed_tokens.weight.numel()
    head = lm.model.lm_head.weight.numel()
    body = sum(p.numel() for p in lm.model.parameters()) - emb - head
    flops = 2 * body * prompt + 2 * head + 2 * c.num_layers * prompt * prompt * c.num_heads * c.head_dim
    return prompt / t, flops / t


def measure(lm: LoadedModel, threads: tuple[int, ...] = (1, 2), batch: int = 8, context: int = 512, prompt: int = 512) -> list[dict]:
    """All measurements for each thread count (restores the previous thread count), on the model's device."""
    device = str(lm.model.lm_head.weight.device)
    dtype = lm.model.lm_head.weight.dtype
    gc.collect()  # as the servers do once started: the loaded model's objects out of the collections a step triggers
    gc.freeze()
    before = torch.get_num_threads()
    rows = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            bw, peak = memcpy_bandwidth(device=device), matmul_peak(device=device, dtype=dtype)
            peak32 = peak if dtype == torch.float32 else matmul_peak(device=device)
            step, nbytes = decode_step(lm, batch, context)
            read = read_bandwidth(nbytes, device=device)
            tok_s, flop_s = prefill(lm, prompt)
            rows.append({"threads": n, "dtype": str(dtype).removeprefix("torch."), "memcpy_GBps": bw / 1e9,
                         "matmul_GFLOPs": peak / 1e9, "matmul_fp32_GFLOPs": peak32 / 1e9,
                         "decode_batch": batch, "decode_context": context, "decode_step_ms": step * 1e3,
                         "decode_bound_ms": nbytes / bw * 1e3, "decode_bytes_MB": nbytes / 1e6,
                         "read_GBps": read / 1e9, "decode_read_fraction": nbytes / step / read,
                         "prefill_tokens": prompt, "prefill_tok_s": tok_s, "prefill_GFLOPs": flop_s / 1e9})
    finally:
        torch.set_num_threads(before)
        gc.unfreeze()  # the caller's objects back to the collector as they were
    return rows


def format_rows(rows: list[dict], model: str) -> str:
    """Markdown lines for ``measure`` output (rows without "dtype" are float32)."""
    dtype = rows[0].get("dtype", "float32") if rows else "float32"
    note = [] if dtype == "float32" else [
        f"(torch's {dtype} peak is its own {dtype} GEMM, emulated on a CPU without {dtype} arithmetic such as AVX2: a "
        "prefill above 100% of it is possible. splitserve's CPU kernels compute in float32, so the float32 peak is "
        "their compute bound.)", ""]
    out = [f"Engine efficiency ({model}, {dtype}):", "", *note,
           "| threads | memcpy GB/s | decode step (ms) | bandwidth bound (ms) | step ÷ bound | read GB/s (same size) "
           f"| decode reads at ÷ read | prefill tok/s | prefill GFLOP/s | torch {dtype} matmul peak GFLOP/s "
           "| prefill ÷ peak |" + ("" if dtype == "float32" else " float32 peak GFLOP/s | prefill ÷ float32 peak |"),
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("" if dtype == "float32" else "---|---|")]
    for r in rows:
        out.append(f"| {r['threads']} | {r['memcpy_GBps']:.1f} | {r['decode_step_ms']:.1f} (batch {r['decode_batch']}, ctx {r['decode_context']}) | "
                   f"{r['decode_bound_ms']:.1f} ({r['decode_bytes_MB']:.0f} MB) | {r['decode_step_ms'] / r['decode_bound_ms']:.1f}× | "
                   f"{r['read_GBps']:.1f} | {100 * r['decode_read_fraction']:.0f}% | "
                   f"{r['prefill_tok_s']:.0f} ({r['prefill_tokens']} tok) | {r['prefill_GFLOPs']:.1f} | {r['matmul_GFLOPs']:.1f} | "
                   f"{100 * r['prefill_GFLOPs'] / r['matmul_GFLOPs']:.0f}% |"
                   + ("" if dtype == "float32" else f" {r['matmul_fp32_GFLOPs']:.1f} | "
                      f"{100 * r['prefill_GFLOPs'] / r['matmul_fp32_GFLOPs']:.0f}% |"))
    return "\n".join(out)
