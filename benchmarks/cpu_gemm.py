"""The projections of a model's decoder layers on torch.mm (MKL sgemm) vs splitserve's packed CPU GEMM kernel, per
row count M (decode batch or prefill tokens) and thread count. Prints numbers; not a test.

    .venv/bin/python benchmarks/cpu_gemm.py [--model synthetic:llama-25m] [--rows 1,4,16,32,128,512]
        [--threads 1,2] [--repeat 9]

Every layer gets its own weights (as in the model: the whole set is larger than the caches), so each run of all
layers reads the weights from memory as a decode step does. Reports the best of ``--repeat`` runs (on a shared
machine other processes only ever add time) and the ratio torch.mm / kernel, measured back to back in one run.
"""

from __future__ import annotations

import argparse
import time

import torch

from splitserve.kernels import build, cpu_gemm
from splitserve.model.config import ModelConfig


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of the fused projections of one layer: QKV, o_proj, gate/up, down."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:llama-25m")
    ap.add_argument("--rows", default="1,4,16,32,128,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=9)
    a = ap.parse_args()
    if build.load() is None:
        raise SystemExit("the CPU GEMM kernel is not available (PD_CPU_KERNELS=0, no AVX2, or no g++)")
    from splitserve.model import load_model

    cfg = load_model(a.model, weights=False).config
    shapes = projection_shapes(cfg)
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) for k, n in shapes] for _ in range(cfg.num_layers)]
    transposed = [[w.t().contiguous() for w in layer] for layer in weights]  # what torch.mm gets in the model
    packed = [[cpu_gemm.pack(w) for w in layer] for layer in weights]
    mb = sum(w.numel() * 4 for layer in weights for w in layer) / 1e6
    print(f"{a.model}: {cfg.num_layers} layers x {len(shapes)} projections, {mb:.0f} MB of float32 weights; "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| M (rows) | threads | torch.mm ms | kernel ms | torch.mm / kernel | kernel GB/s of weights |")
    print("|---|---|---|---|---|---|")
    for m in (int(x) for x in a.rows.split(",")):
        xs = [torch.randn(m, k, generator=g) for k, _ in shapes]
        for threads in (int(x) for x in a.threads.split(",")):
            torch.set_num_threads(threads)

            def on_mm(xs=xs):
                for layer in transposed:
                    for x, w in zip(xs, layer):
                        torch.mm(x, w)

            def on_kernel(xs=xs):
                for layer in packed:
                    for x, p, (_, n) in zip(xs, layer, shapes):
                        cpu_gemm.packed_gemm(x, p, n)

            mm, kernel = best_ms(on_mm, a.repeat), best_ms(on_kernel, a.repeat)
            print(f"| {m} | {threads} | {mm:.2f} | {kernel:.2f} | {mm / kernel:.2f}x | {mb / kernel:.1f} |", flush=True)


if __name__ == "__main__":
    main()
