"""Fixed-shape paged attention for decode steps that CUDA graphs replay (``splitserve.engine.cuda_graphs``).

A decode step of B sequences (one new token each), every sequence given M KV blocks: its block table padded to
M with any valid block id, its context masked by ``context_lens``. Every tensor shape depends on (B, M) only
and nothing reads back to the host, so a step can be captured once per (B, M) bucket and replayed with new
inputs copied into the same buffers. Same cache layout and math as :mod:`splitserve.model.attention`'s
decode path (whole-block ``index_select``, SDPA in grouped-query mode); runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StaticDecodePlan:
    """Per-step decode indices of fixed shape (shared by all layers).

    Attributes:
        write_blocks: int64 ``[B]`` KV block of each new token.
        write_offsets: int64 ``[B]`` row of each new token within its block.
        blocks: int64 ``[B * M]`` block ids to gather, M per sequence.
        num_blocks: M.
        mask: bool ``[B, 1, 1, M * block_size]``, True = attend (position < context length).
    """

    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    blocks: torch.Tensor
    num_blocks: int
    mask: torch.Tensor


def static_decode_plan(slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                       block_size: int) -> StaticDecodePlan:
    """Device-side plan of one decode step (no host sync; capturable).

    Args:
        slot_mapping: int64 ``[B]`` KV slot of each new token, ``block_id * block_size + offset``.
        block_tables: int64 ``[B, M]`` block ids per sequence (padding: any valid block id, masked out).
        context_lens: int64 ``[B]`` tokens each sequence attends to (cached + the new one), 1..M * block_size.
        block_size: tokens per KV block.
    """
    b, m = block_tables.shape
    span = torch.arange(m * block_size, device=block_tables.device)
    mask = (span[None, :] < context_lens[:, None]).view(b, 1, 1, m * block_size)
    return StaticDecodePlan(torch.div(slot_mapping, block_size, rounding_mode="floor"),
                            torch.remainder(slot_mapping, block_size), block_tables.reshape(-1), m, mask)


def static_decode_attention(qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int, plan: StaticDecodePlan,
                            num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Write the B new tokens' K/V for ``layer``, then attend over each sequence's M blocks.

    Args:
        qkv: ``[B, num_heads + 2 * num_kv_heads, head_dim]`` (q and k RoPE-rotated).
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, updated in place.
    Returns:
        ``[B, num_heads * head_dim]`` (softmax scale 1/sqrt(head_dim)).
    """
    b, _, d = qkv.shape
    hq, hkv = num_heads, num_kv_heads
    cache = kv_cache.select(1, layer)  # [N, 2, bs, Hkv, D]
    cache[plan.write_blocks, :, plan.write_offsets] = qkv[:, hq:].view(b, 2, hkv, d)
    span = plan.num_blocks * cache.shape[2]
    k = cache[:, 0].index_select(0, plan.blocks).view(b, span, hkv, d).transpose(1, 2)  # [B, Hkv, span, D]
    v = cache[:, 1].index_select(0, plan.blocks).view(b, span, hkv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(qkv[:, :hq].unsqueeze(2), k, v, attn_mask=plan.mask, enable_gqa=True)
    return o.reshape(b, hq * d)
