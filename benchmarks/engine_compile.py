"""What ``torch.compile`` (inductor, C++ backend) gives the engine's forward on CPU, measured in one run
(prints numbers; not a test, and not used by the engine).

The per-forward Python work (``plan_attention``, RoPE table lookup) stays eager; the layer stack
(embedding, every decoder layer with its paged-attention call, final norm, lm_head) is compiled as one
function. Each case reports the first call (compile time: the start-up cost of each new shape), the number
of distinct graphs compiled so far (a new batch size or sequence length may recompile), whether the
compiled greedy tokens equal eager's, and the median step time of eager and compiled alternated
(eager, compiled, x3) in the same process.

    .venv/bin/python benchmarks/engine_compile.py [--dtype float32] [--threads 1] [--dynamic 1]
        [--cases b1c128:1:128:1,b16c128:16:128:1,p512:1:511:512]

A case ``name:batch:context:new_tokens`` feeds ``new_tokens`` tokens per sequence ending at position
``context`` (new_tokens 1: decode; = context + 1: a whole prompt).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from splitserve.model import AttentionMetadata, load_model
from splitserve.model.attention import plan_attention

BS = 16


def make_body(m):
    def body(input_ids, cos, sin, kv_cache, plan):
        h = F.embedding(input_ids, m.model.embed_tokens.weight)
        for i, layer in enumerate(m.model.layers):
            h = layer.forward(h, cos, sin, kv_cache, i, plan, None)
        if plan.last_token_index is not None:
            h = h[plan.last_token_index]
        last = F.rms_norm(h, (m.config.hidden_size,), m.model.norm.weight, m.model.norm.eps)
        return F.linear(last, m.lm_head.weight).float()
    return body


def make_inputs(m, batch: int, ctx: int, qlen: int):
    per = -(-(ctx + 1) // BS)
    cache = m.allocate_kv_cache(batch * per, BS)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    slots = torch.tensor([t[p // BS] * BS + p % BS for t in tables for p in range(ctx + 1 - qlen, ctx + 1)])
    attn = AttentionMetadata(slots, [qlen] * batch, [ctx + 1] * batch, tables, BS)
    return torch.full((batch * qlen,), 100), torch.arange(ctx + 1 - qlen, ctx + 1).repeat(batch), cache, attn


def step(m, fn, ids, pos, cache, attn) -> torch.Tensor:
    with torch.inference_mode():
        plan = plan_attention(attn, ids.shape[0], cache)
        cos, sin = m.rotary.cos_sin(pos, max(attn.seq_lens), m.lm_head.weight.dtype)
        return fn(ids, cos, sin, cache, plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama-25m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dynamic", type=int, default=1, help="1: torch.compile(dynamic=True); 0: one graph per shape")
    ap.add_argument("--cases", default="b1c128:1:128:1,b1c300:1:300:1,b16c128:16:128:1,b4c64:4:64:1,p512:1:511:512,p300:1:299:300")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = load_model(a.model, dtype=a.dtype).model
    body = make_body(m)
    compiled = torch.compile(body, dynamic=bool(a.dynamic))
    print(f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; {a.model} {a.dtype}; {a.threads} thread(s); "
          f"dynamic={bool(a.dynamic)}")
    print("| case | first call s | graphs so far | argmax equal | max abs diff | eager ms (x3) | compiled ms (x3) |")
    print("|---|---|---|---|---|---|---|")
    for spec in a.cases.split(","):
        name, b, c, q = spec.split(":")
        args = make_inputs(m, int(b), int(c), int(q))
        t = time.perf_counter()
        out_c = step(m, compiled, *args)
        first = time.perf_counter() - t
        out_e = step(m, body, *args)
        same = torch.equal(out_c.argmax(-1), out_e.argmax(-1))
        res: dict[str, list[float]] = {"eager": [], "compiled": []}
        n = 30 if q == "1" else 3
        for _ in range(3):
            for label, fn in (("eager", body), ("compiled", compiled)):
                ts = []
                for _ in range(n):
                    t = time.perf_counter()
                    step(m, fn, *args)
                    ts.append(time.perf_counter() - t)
                res[label].append(statistics.median(ts) * 1e3)
        fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        print(f"| {name} | {first:.1f} | {counters['stats']['unique_graphs']} | {same} | {(out_c - out_e).abs().max().item():.1e} "
              f"| {fmt(res['eager'])} | {fmt(res['compiled'])} |", flush=True)


if __name__ == "__main__":
    main()
