"""The small per-layer operations of CPU models on the packed kernels (float32 activations) (``cpu_layer_ops.cpp``), one kernel call each.

On a decode step the projections move most bytes, but a layer also ran ~15 small ATen ops (``F.rms_norm`` alone is
five: pow, mean, add, rsqrt, mul; RoPE three plus a ``roll``; the KV store an ``index_put_``; SiLU and the gate-up
multiply two), each 5-90 us on this project's 2-core machine at 16 rows, ~15% of a 16-sequence step
(``torch.profiler``, 2026-12-02). These kernels do each group in one pass over its rows. Every row is computed
alone, so results do not depend on the batch. Used by :mod:`splitserve.model` when the model runs on the packed
GEMM (:meth:`~splitserve.model.llama.CausalLM.pack_for_cpu`); built and loaded by :mod:`splitserve.kernels.build`.
"""

from __future__ import annotations

import torch

from splitserve.kernels import build


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x * rsqrt(mean(x**2, -1) + eps)) * weight`` (Hugging Face Llama's RMSNorm; Zhang & Sennrich 2019).

    Args:
        x: float32 ``[M, K]`` on the CPU (copied if not contiguous).
        weight: float32 ``[K]``.
    Returns:
        float32 ``[M, K]``; within a few ulp of ``F.rms_norm`` (the sum of squares runs in 8 lanes).
    Raises:
        RuntimeError: wrong shapes or dtypes, or the kernels are not loaded.
    """
    return build.required().rms_norm(x if x.is_contiguous() else x.contiguous(), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up projection's output (SwiGLU; Shazeer 2020).

    Args:
        gate_up: float32 ``[M, 2I]``, gate columns then up columns (copied if not contiguous).
    Returns:
        float32 ``[M, I]``, contiguous (the down projection's input).
    Raises:
        RuntimeError: an odd column count, wrong dtype, or the kernels are not loaded.
    """
    return build.required().silu_mul(gate_up if gate_up.is_contiguous() else gate_up.contiguous())


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  block_ids: torch.Tensor, offsets: torch.Tensor, num_kv_heads: int) -> None:
    """Rotate q and k heads in place (Hugging Face rotate-half RoPE), then store each token's K and V rows in the cache.

    Args:
        qkv: float32 ``[T, Hq + 2 * Hkv, D]`` contiguous: the fused QKV projection's output (q heads, k, v).
        cos, signed_sin: float32 ``[T, D]`` (or ``[T, 1, D]``) from ``RotaryEmbedding.cos_sin`` (sin's first half
            negated): a rotated head is ``x * cos + roll(x, D / 2) * signed_sin``.
        kv_cache: ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` float32, bfloat16 or float16, contiguous;
            token t's K goes to ``kv_cache[block_ids[t], layer, 0, offsets[t]]``, its V to ``[..., 1, ...]``. A
            16-bit cache stores them rounded to nearest even (torch's conversion) and qkv's k and v heads are
            replaced by the rounded values, so attention over this step's K/V equals attention over the cache.
        block_ids, offsets: int64 ``[T]``, each token's slot (``slot_mapping // block_size``, ``% block_size``).
    Raises:
        RuntimeError: shapes, dtypes or layouts that do not match, a slot outside the cache, or no kernels.
    """
    t, d = qkv.shape[0], qkv.shape[-1]
    build.required().rope_write_kv(qkv, cos.reshape(t, d), signed_sin.reshape(t, d), kv_cache, layer, block_ids, offsets,
                            num_kv_heads)
