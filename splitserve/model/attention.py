"""Paged attention over one block-major KV cache tensor.

Cache layout: ``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (index 0 = K,
1 = V). Token ``p`` of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

``plan_attention`` validates an ``AttentionMetadata`` once per forward and precomputes the gather
indices; ``paged_attention`` then runs per layer: write the new K/V, attend over the cached context.
Sequences with one new token (decode) are gathered into padded batches of similar context length
(the longest context of a batch at most twice its shortest, so one long sequence does not make every
short one pay for its length) and each batch is served by one SDPA call; the others (prefill,
prefix-cached prefill) run one SDPA call each with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where the new tokens of a packed varlen batch go and what each sequence attends to.

    Attributes:
        slot_mapping: int64 ``[T]``; KV slot of each new token, ``block_id * block_size + offset``.
        query_lens: new tokens per sequence (sum = T, each >= 1).
        seq_lens: total context per sequence after this step (cached + new), each >= its query_len.
        block_tables: per sequence, block ids covering its first seq_len positions.
        block_size: tokens per block; must equal ``kv_cache.shape[3]``.
    """

    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int


@dataclass
class _Prefill:
    start: int  # first token of this sequence in the packed batch
    qlen: int
    seq_len: int
    ctx_blocks: torch.Tensor | None  # [seq_len] block id of each context position (None: all tokens are new)
    ctx_offsets: torch.Tensor | None  # [seq_len]


@dataclass
class _DecodeGroup:
    tokens: torch.Tensor  # [B] token index of each batched decode sequence
    blocks: torch.Tensor  # [B, M]
    offsets: torch.Tensor  # [B, M]
    mask: torch.Tensor  # [B, 1, 1, M] bool, True = attend


@dataclass
class AttentionPlan:
    """Per-forward indices derived from AttentionMetadata (shared by all layers)."""

    write_blocks: torch.Tensor  # [T]
    write_offsets: torch.Tensor  # [T]
    last_token_index: torch.Tensor  # [num_seqs] index of each sequence's last token in the batch
    decode_groups: list[_DecodeGroup] = field(default_factory=list)  # decodes of similar context length
    prefills: list[_Prefill] = field(default_factory=list)


def _context_slots(table: list[int], seq_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    nblk = -(-seq_len // block_size)
    blocks = torch.tensor(table[:nblk], dtype=torch.int64).repeat_interleave(block_size)[:seq_len]
    offsets = torch.arange(seq_len, dtype=torch.int64) % block_size
    return blocks, offsets


def plan_attention(attn: AttentionMetadata, num_tokens: int, kv_cache: torch.Tensor, fast_decode: bool = True) -> AttentionPlan:
    """Validate ``attn`` against the batch and cache and precompute gather/scatter indices.

    Args:
        num_tokens: T, the number of packed new tokens.
        kv_cache: the 6-D cache (only its shape and device are used).
        fast_decode: batch all query_len == 1 sequences into one padded SDPA call.

    Raises:
        ValueError: inconsistent lengths, block tables too short, ids out of range, or a slot_mapping
            that disagrees with the block tables.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    num_blocks, bs = kv_cache.shape[0], kv_cache.shape[3]
    if attn.block_size != bs:
        raise ValueError(f"attn.block_size={attn.block_size} but kv_cache block size is {bs}")
    n = len(attn.query_lens)
    if n == 0 or len(attn.seq_lens) != n or len(attn.block_tables) != n:
        raise ValueError(
            f"query_lens ({n}), seq_lens ({len(attn.seq_lens)}) and block_tables ({len(attn.block_tables)}) "
            "must be non-empty and of equal length"
        )
    if sum(attn.query_lens) != num_tokens or attn.slot_mapping.numel() != num_tokens:
        raise ValueError(
            f"sum(query_lens)={sum(attn.query_lens)} and len(slot_mapping)={attn.slot_mapping.numel()} "
            f"must both equal the number of input tokens {num_tokens}"
        )
    slots = attn.slot_mapping.detach().to("cpu", torch.int64).reshape(-1)
    dev = kv_cache.device
    plan_prefills: list[_Prefill] = []
    dec_tok: list[int] = []
    dec_ctx: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = 0
    for i, (qlen, slen, table) in enumerate(zip(attn.query_lens, attn.seq_lens, attn.block_tables)):
        if not 1 <= qlen <= slen:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= seq_len, got query_len={qlen} seq_len={slen}")
        if len(table) * bs < slen:
            raise ValueError(f"sequence {i}: block table of {len(table)} blocks cannot hold seq_len={slen} (block_size {bs})")
        used = table[: -(-slen // bs)]
        if min(used) < 0 or max(used) >= num_blocks:
            raise ValueError(f"sequence {i}: block id out of range [0, {num_blocks}) in {used}")
        blocks, offsets = _context_slots(table, slen, bs)
        expected = blocks[slen - qlen :] * bs + offsets[slen - qlen :]
        if not torch.equal(expected, slots[start : start + qlen]):
            raise ValueError(
                f"sequence {i}: slot_mapping {slots[start:start + qlen].tolist()} does not match its block table "
                f"for positions {slen - qlen}..{slen - 1} (expected {expected.tolist()})"
            )
        if fast_decode and qlen == 1:
            dec_tok.append(start)
            dec_ctx.append((blocks, offsets))
        elif qlen == slen:
            plan_prefills.append(_Prefill(start, qlen, slen, None, None))
        else:
            plan_prefills.append(_Prefill(start, qlen, slen, blocks.to(dev), offsets.to(dev)))
        start += qlen
    plan = AttentionPlan(
        write_blocks=(slots // bs).to(dev),
        write_offsets=(slots % bs).to(dev),
        last_token_index=(torch.tensor(attn.query_lens, dtype=torch.int64).cumsum(0) - 1).to(dev),
        prefills=plan_prefills,
    )
    order = sorted(range(len(dec_tok)), key=lambda j: dec_ctx[j][0].numel())
    while order:  # shortest first; a group takes sequences up to twice its shortest context
        limit = 2 * dec_ctx[order[0]][0].numel()
        n = next((k for k, j in enumerate(order) if dec_ctx[j][0].numel() > limit), len(order))
        plan.decode_groups.append(_decode_group([dec_tok[j] for j in order[:n]], [dec_ctx[j] for j in order[:n]], dev))
        order = order[n:]
    return plan


def _decode_group(tokens: list[int], ctx: list[tuple[torch.Tensor, torch.Tensor]], dev: torch.device) -> _DecodeGroup:
    m = max(b.numel() for b, _ in ctx)
    blocks = torch.zeros(len(tokens), m, dtype=torch.int64)
    offsets = torch.zeros(len(tokens), m, dtype=torch.int64)
    mask = torch.zeros(len(tokens), 1, 1, m, dtype=torch.bool)
    for j, (b, o) in enumerate(ctx):
        blocks[j, : b.numel()], offsets[j, : o.numel()], mask[j, ..., : b.numel()] = b, o, True
    return _DecodeGroup(torch.tensor(tokens, dtype=torch.int64, device=dev), blocks.to(dev), offsets.to(dev), mask.to(dev))


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[..., Hkv, S, D]`` -> ``[..., Hkv * groups, S, D]``; KV head h serves query heads h*groups..h*groups+groups-1."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, plan: AttentionPlan
) -> torch.Tensor:
    """Write new K/V for ``layer`` into the cache, then attend.

    Args:
        q: ``[T, Hq, D]`` queries (RoPE applied). k, v: ``[T, Hkv, D]`` new keys/values (RoPE applied to k).
        kv_cache: 6-D cache, updated in place at the planned slots.
    Returns:
        ``[T, Hq, D]`` attention output (softmax scale 1/sqrt(D)).
    """
    groups = q.shape[1] // k.shape[1]
    kv_cache[plan.write_blocks, layer, :, plan.write_offsets] = torch.stack((k, v), dim=1)
    out = torch.empty_like(q)
    for g in plan.decode_groups:
        ctx = kv_cache[g.blocks, layer, :, g.offsets]  # [B, M, 2, Hkv, D]
        kc = _expand_kv(ctx[:, :, 0].transpose(1, 2), groups)  # [B, Hq, M, D]
        vc = _expand_kv(ctx[:, :, 1].transpose(1, 2), groups)
        qd = q[g.tokens].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=g.mask)
        out[g.tokens] = o.squeeze(2)
    for p in plan.prefills:
        qs = q[p.start : p.start + p.qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        if p.ctx_blocks is None:  # all context is new: use k/v directly (identical to the cached copy)
            kc = k[p.start : p.start + p.qlen]
            vc = v[p.start : p.start + p.qlen]
            mask, causal = None, True
        else:
            ctx = kv_cache[p.ctx_blocks, layer, :, p.ctx_offsets]  # [S, 2, Hkv, D]
            kc, vc = ctx[:, 0], ctx[:, 1]
            qpos = torch.arange(p.seq_len - p.qlen, p.seq_len, device=q.device)
            mask = torch.arange(p.seq_len, device=q.device)[None, :] <= qpos[:, None]  # [qlen, S]
            causal = False
        kc = _expand_kv(kc.transpose(0, 1).unsqueeze(0), groups)
        vc = _expand_kv(vc.transpose(0, 1).unsqueeze(0), groups)
        o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask, is_causal=causal)
        out[p.start : p.start + p.qlen] = o[0].transpose(0, 1)
    return out
