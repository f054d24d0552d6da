"""Reference paged attention: per-token gathers and materialised GQA K/V, one SDPA call per sequence.

Slow on purpose and independent of ``attention.plan_attention``: the tests run the model with
``CausalLM.reference_attention = True`` and compare against the block-gather path of ``attention.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.model.attention import AttentionMetadata


def reference_attention(qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int, attn: AttentionMetadata,
                        num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Write this layer's new K/V token by token, then attend sequence by sequence.

    Args:
        qkv: ``[T, num_heads + 2 * num_kv_heads, head_dim]`` (q and k RoPE-rotated).
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, updated in place.
    Returns:
        ``[T, num_heads * head_dim]`` attention output (softmax scale 1/sqrt(head_dim)).
    """
    t, _, d = qkv.shape
    bs, groups = attn.block_size, num_heads // num_kv_heads
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    dev = qkv.device
    slots = attn.slot_mapping.to(dev, torch.int64)
    kv_cache[slots // bs, layer, 0, slots % bs] = k.to(kv_cache.dtype)  # float32 activations over a 16-bit
    kv_cache[slots // bs, layer, 1, slots % bs] = v.to(kv_cache.dtype)  # cache (the CPU kernels): rounded
    out = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=dev)
    start = 0
    for qlen, slen, table in zip(attn.query_lens, attn.seq_lens, attn.block_tables):
        pos = torch.arange(slen, device=dev)
        blocks = torch.tensor(table, dtype=torch.int64, device=dev)[pos // bs]
        kc = kv_cache[blocks, layer, 0, pos % bs].transpose(0, 1).repeat_interleave(groups, dim=0).to(q.dtype)  # [Hq, S, D]
        vc = kv_cache[blocks, layer, 1, pos % bs].transpose(0, 1).repeat_interleave(groups, dim=0).to(q.dtype)
        qs = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
        mask = pos[None, :] <= torch.arange(slen - qlen, slen, device=dev)[:, None]  # [qlen, S]
        out[start : start + qlen] = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask).transpose(0, 1)
        start += qlen
    return out.view(t, num_heads * d)
