"""The packed GEMM of the projections (``cpu_kernels.cpp``: ``packed_gemm``): pack, unpack, call.

A decode step multiplies a few rows (one per running sequence, M = 1..64) by every weight matrix. A general
sgemm (MKL, through ``torch.mm``) packs or strides through the weight on every call and, measured on this
project's 2-core AVX2 machine, ran M = 2..16 at half the speed the weight bytes allow (M = 4 took 2.2x as long
as this kernel; ``benchmarks/cpu_gemm.py``, ``benchmarks/results/engine_cpu_kernels.txt``). Weights are therefore
packed once, at load, into 16-column panels ``[ceil(N/16), K, 16]`` that the kernel streams sequentially; it
serves every M (prefill too). Weights may be packed in float32, bfloat16 or float16; inputs, accumulation and
outputs are float32 either way (16-bit weights are widened as they are read: weight-only reduced precision, half
the bytes per decode step). Built and loaded by :mod:`splitserve.kernels.build`.
"""

from __future__ import annotations

import torch

from splitserve.kernels import build

PANEL = 16  # output columns per packed panel (two AVX2 vectors)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Pack a Linear weight ``W`` ``[N, K]`` (float32, bfloat16 or float16; kept in its dtype) into panels
    ``[ceil(N/16), K, 16]``: panel p, row k holds ``W[16p : 16p + 16, k]``, zero-padded past N."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[N, K]`` weight back from :func:`pack`'s panels (a copy)."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:n].contiguous()


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T`` (residual optional) with W packed by :func:`pack`.

    Args:
        x: float32 ``[M, K]`` on the CPU (made contiguous if it is not).
        packed: ``[ceil(N/16), K, 16]`` from :func:`pack` (float32, bfloat16 or float16).
        n: N, the output columns.
        residual: float32 ``[M, N]`` or None.
    Returns:
        float32 ``[M, N]``.
    Raises:
        RuntimeError: the kernels are not loaded (check :func:`splitserve.kernels.build.load` first) or shapes/dtypes do not match.
    """
    module = build.required()  # whatever PD_CPU_KERNELS says now: weights packed while it was on keep running on it
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    return module.packed_gemm(x if x.is_contiguous() else x.contiguous(), packed, n, residual, 0)  # 0: torch's thread count
