"""A decoder layer of a decode-only step as one kernel call (``cpu_decoder_layer.cpp``).

The Python layer (:class:`splitserve.model.llama.DecoderLayer`) on the packed kernels makes ~20 Python-level calls
per layer (kernel wrappers, views, ``nn.Module`` attribute lookups); on a small model that was ~25% of a decode
step on this project's 2-core machine (cProfile, 2026-12-02). :func:`decoder_layer` runs the same kernels in the
same order in C++, so its output is bit for bit the Python layer's. It serves decode-only steps on the in-place
decode attention kernel, for layers without q/k norms (Qwen3's run the Python layer). Built and loaded by
:mod:`splitserve.kernels.build`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.kernels import build


@dataclass(frozen=True)
class LayerWeights:
    """One layer's packed weights (:meth:`splitserve.model.llama.DecoderLayer.fused_weights`).

    Attributes:
        input_norm, post_norm: float32 ``[hidden]`` RMSNorm weights; eps their epsilon.
        qkv, o, gate_up, down: packed panels (:func:`splitserve.kernels.cpu_gemm.pack`) of the fused QKV, o_proj,
            fused gate/up and down projections; qkv_bias, o_bias float32 or None.
        num_heads, num_kv_heads, head_dim, intermediate: the layer's shape.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int


def decoder_layer(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, signed_sin: torch.Tensor,
                  kv_cache: torch.Tensor, layer: int, write_blocks: torch.Tensor, write_offsets: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """``h + attn(norm(h))``, then that ``+ mlp(norm(that))``, for T decodes (one new token each).

    Args:
        h: float32 ``[T, hidden]`` contiguous.
        cos, signed_sin: float32 ``[T, head_dim]`` (``RotaryEmbedding.cos_sin``, reshaped).
        kv_cache: ``[num_blocks, num_layers, 2, block_size, Hkv, head_dim]`` (float32, bfloat16 or float16); this
            step's K/V are stored at ``(write_blocks[t], layer, 0/1, write_offsets[t])`` (int64 ``[T]`` each).
        block_tables: int64 ``[T, M]``, seq_lens int64 ``[T]``: each decode's context (this token included).
    Returns:
        float32 ``[T, hidden]``.
    Raises:
        RuntimeError: shapes or dtypes that do not match (the kernels' checks), or the kernels are not loaded.
    """
    return build.required().decoder_layer(
        h, w.input_norm, w.post_norm, w.eps, w.qkv, w.qkv_bias, w.o, w.o_bias, w.gate_up, w.down, w.num_heads,
        w.num_kv_heads, w.head_dim, w.intermediate, cos, signed_sin, kv_cache, layer, write_blocks, write_offsets,
        block_tables, seq_lens, w.head_dim ** -0.5)
