"""Paged attention over one block-major KV cache tensor, gathering whole KV blocks.

Cache layout: ``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (index 0 = K,
1 = V). Token ``p`` of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

``plan_attention`` validates an ``AttentionMetadata`` once per forward (plain Python over the block
tables) and precomputes the block ids to gather and the masks (on a GPU its index tensors go up in one copy and
the masks are built there); ``paged_attention`` then runs per layer:
write the new K/V with one indexed store, gather each sequence's context as whole blocks
(``index_select`` over the block axis: one copy of ``num_blocks * block_size`` tokens, no per-token
index), and attend with SDPA's grouped-query mode (K/V are never repeated per query head).
Sequences with one new token (decode) are batched by similar context length (the longest context of
a batch at most twice its shortest) into one SDPA call per batch, padded to whole blocks and masked (on the CPU,
for float32 activations, splitserve's kernel instead reads every decode's K/V in place in one call:
:mod:`splitserve.kernels.paged_decode`);
the others (prefill, prefix-cached prefill) run one SDPA call each, causal without a mask when the
whole context is new.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from splitserve.kernels import paged_decode


@dataclass
class AttentionMetadata:
    """Where the new tokens of a packed varlen batch go and what each sequence attends to.

    Attributes:
        slot_mapping: int64 ``[T]``; KV slot of each new token, ``block_id * block_size + offset``.
        query_lens: new tokens per sequence (sum = T, each >= 1).
        seq_lens: total context per sequence after this step (cached + new), each >= its query_len.
        block_tables: per sequence, block ids covering its first seq_len positions.
        block_size: tokens per block; must equal ``kv_cache.shape[3]``.
        on_layer_done: called with ``i`` after layer ``i`` wrote its K/V (KV push of prefill steps); None: not.
    """

    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    on_layer_done: Callable[[int], None] | None = None


@dataclass
class _Prefill:
    start: int  # first token of this sequence in the packed batch
    qlen: int
    seq_len: int
    blocks: torch.Tensor | None  # [ceil(seq_len / block_size)] context block ids (None: all tokens are new)
    mask: torch.Tensor | None  # [qlen, seq_len] bool, True = attend (offset causal)


@dataclass
class _DecodeGroup:
    tokens: torch.Tensor | None  # [B] token index of each sequence in the batch (None: tokens 0..B-1 in order)
    blocks: torch.Tensor  # [B * M] block ids, M blocks per sequence (padded with its last block)
    num_blocks: int  # M
    length: int  # longest context of the group, tokens
    mask: torch.Tensor | None  # [B, 1, 1, length] bool, True = attend (None: every context is ``length`` long)


@dataclass
class _InPlaceDecode:
    """Every decode of the step for the CPU kernel (:mod:`splitserve.kernels.paged_decode`), read in place."""

    tokens: torch.Tensor | None  # [B] token index of each decode in the batch (None: tokens 0..B-1 in order)
    block_tables: torch.Tensor  # [B, M] int64, rows padded with their last block (never read past seq_lens)
    seq_lens: torch.Tensor  # [B] int64


@dataclass
class AttentionPlan:
    """Per-forward indices derived from AttentionMetadata (shared by all layers)."""

    write_blocks: torch.Tensor  # [T]
    write_offsets: torch.Tensor  # [T]
    last_token_index: torch.Tensor | None  # [num_seqs] each sequence's last token (None: T == num_seqs)
    decode_groups: list[_DecodeGroup] = field(default_factory=list)
    prefills: list[_Prefill] = field(default_factory=list)
    in_place_decode: _InPlaceDecode | None = None  # the decodes, when the CPU kernel serves them (no groups then)
    cpu_kv_write: bool = False  # the CPU kernels serve this cache and activations: RoPE + K/V store run as one call


def _check(attn: AttentionMetadata, num_tokens: int, num_blocks: int, bs: int) -> list[int]:
    """Validate the metadata in plain Python; returns the slot_mapping as a list."""
    n = len(attn.query_lens)
    if n == 0 or len(attn.seq_lens) != n or len(attn.block_tables) != n:
        raise ValueError(
            f"query_lens ({n}), seq_lens ({len(attn.seq_lens)}) and block_tables ({len(attn.block_tables)}) "
            "must be non-empty and of equal length"
        )
    slots = attn.slot_mapping.reshape(-1).tolist()
    if sum(attn.query_lens) != num_tokens or len(slots) != num_tokens:
        raise ValueError(
            f"sum(query_lens)={sum(attn.query_lens)} and len(slot_mapping)={len(slots)} "
            f"must both equal the number of input tokens {num_tokens}"
        )
    start = 0
    for i, (qlen, slen, table) in enumerate(zip(attn.query_lens, attn.seq_lens, attn.block_tables)):
        if not 1 <= qlen <= slen:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= seq_len, got query_len={qlen} seq_len={slen}")
        if len(table) * bs < slen:
            raise ValueError(f"sequence {i}: block table of {len(table)} blocks cannot hold seq_len={slen} (block_size {bs})")
        used = table[: -(-slen // bs)]
        if min(used) < 0 or max(used) >= num_blocks:
            raise ValueError(f"sequence {i}: block id out of range [0, {num_blocks}) in {used}")
        expected = [table[p // bs] * bs + p % bs for p in range(slen - qlen, slen)]
        if slots[start : start + qlen] != expected:
            raise ValueError(
                f"sequence {i}: slot_mapping {slots[start:start + qlen]} does not match its block table "
                f"for positions {slen - qlen}..{slen - 1} (expected {expected})"
            )
        start += qlen
    return slots


def plan_attention(attn: AttentionMetadata, num_tokens: int, kv_cache: torch.Tensor,
                   activation_dtype: torch.dtype | None = None) -> AttentionPlan:
    """Validate ``attn`` against the batch and cache and precompute block gathers and masks.

    Args:
        num_tokens: T, the number of packed new tokens.
        kv_cache: the 6-D cache (only its shape, dtype and device are used).
        activation_dtype: the dtype of q/k/v (None: the cache's); the CPU kernels serve float32 activations only.

    Raises:
        ValueError: inconsistent lengths, block tables too short, ids out of range, or a slot_mapping
            that disagrees with the block tables.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    num_blocks, bs = kv_cache.shape[0], kv_cache.shape[3]
    if attn.block_size != bs:
        raise ValueError(f"attn.block_size={attn.block_size} but kv_cache block size is {bs}")
    slots = _check(attn, num_tokens, num_blocks, bs)
    dev = kv_cache.device
    slot_t = torch.tensor(slots, dtype=torch.int64)
    host = [slot_t // bs, slot_t % bs]  # every int64 index tensor of the plan, moved to the device together
    if num_tokens != len(attn.query_lens):
        host.append(torch.tensor(attn.query_lens, dtype=torch.int64).cumsum(0) - 1)
    prefills: list[tuple[int, int, int, int | None]] = []  # (start, qlen, seq_len, its blocks in host or None)
    decodes: list[tuple[int, int, list[int]]] = []  # (token index, seq_len, block table)
    start = 0
    for qlen, slen, table in zip(attn.query_lens, attn.seq_lens, attn.block_tables):
        if qlen == 1:
            decodes.append((start, slen, table))
        elif qlen == slen:
            prefills.append((start, qlen, slen, None))
        else:
            prefills.append((start, qlen, slen, len(host)))
            host.append(torch.tensor(table[: -(-slen // bs)], dtype=torch.int64))
        start += qlen
    cpu_kernels = paged_decode.usable(kv_cache, activation_dtype or kv_cache.dtype)
    in_place = _in_place_decode(decodes, bs, num_tokens) if decodes and cpu_kernels else None
    if in_place is not None:
        decodes = []
    decodes.sort(key=lambda d: d[1])
    groups = []  # (tokens, blocks, lens: indices into host or None; num_blocks, length)
    while decodes:  # shortest first; a group takes sequences up to twice its shortest context
        limit = 2 * decodes[0][1]
        n = next((k for k, d in enumerate(decodes) if d[1] > limit), len(decodes))
        groups.append(_decode_group(decodes[:n], bs, num_tokens, host))
        decodes = decodes[n:]
    t = _to_device(host, dev)
    plan = AttentionPlan(write_blocks=t[0], write_offsets=t[1], last_token_index=t[2] if num_tokens != len(attn.query_lens) else None,
                         in_place_decode=in_place, cpu_kv_write=cpu_kernels)
    for begin, qlen, slen, blocks in prefills:
        mask = None
        if blocks is not None:
            mask = torch.arange(slen, device=dev)[None, :] <= torch.arange(slen - qlen, slen, device=dev)[:, None]
        plan.prefills.append(_Prefill(begin, qlen, slen, None if blocks is None else t[blocks], mask))
    for tokens, blocks, lens, m, length in groups:
        mask = None
        if lens is not None:
            mask = (torch.arange(length, device=dev)[None, :] < t[lens][:, None]).view(-1, 1, 1, length)
        plan.decode_groups.append(_DecodeGroup(None if tokens is None else t[tokens], t[blocks], m, length, mask))
    return plan


def _in_place_decode(decodes: list[tuple[int, int, list[int]]], bs: int, num_tokens: int) -> _InPlaceDecode:
    """The CPU kernel's inputs for ``decodes`` (token index, seq_len, block table), in batch order."""
    tables = _padded_tables(decodes, bs, max(-(-slen // bs) for _, slen, _ in decodes))
    tokens = [d[0] for d in decodes]
    in_order = len(tokens) == num_tokens  # decodes are found in batch order: all of them means tokens 0..T-1
    return _InPlaceDecode(None if in_order else torch.tensor(tokens, dtype=torch.int64),
                          torch.tensor(tables, dtype=torch.int64), torch.tensor([d[1] for d in decodes], dtype=torch.int64))


def _padded_tables(decodes: list[tuple[int, int, list[int]]], bs: int, m: int) -> list[list[int]]:
    """Each decode's context blocks, padded to ``m`` with its last block (padding is masked out or never read)."""
    tables = []
    for _, slen, table in decodes:
        used = table[: -(-slen // bs)]
        tables.append(used + [used[-1]] * (m - len(used)))
    return tables


def _to_device(host: list[torch.Tensor], dev: torch.device) -> list[torch.Tensor]:
    """``host`` (int64 tensors) on ``dev`` in one host-to-device copy; on cpu the tensors themselves."""
    if dev.type == "cpu":
        return host
    return list(torch.cat([h.reshape(-1) for h in host]).to(dev).split([h.numel() for h in host]))


def _decode_group(decodes: list[tuple[int, int, list[int]]], bs: int, num_tokens: int,
                  host: list[torch.Tensor]) -> tuple[int | None, int, int | None, int, int]:
    """Appends the group's index tensors to ``host``; returns (tokens, blocks, lens) as indices into it (tokens None:
    the batch's tokens in order; lens None: every context is the longest), the blocks per sequence and that length."""
    tokens = [d[0] for d in decodes]
    length = max(d[1] for d in decodes)
    m = -(-length // bs)
    blocks = [b for table in _padded_tables(decodes, bs, m) for b in table]
    refs: list[int | None] = []
    for values, needed in ((tokens, sorted(tokens) != tokens or len(tokens) != num_tokens),
                           (blocks, True), ([d[1] for d in decodes], any(d[1] != length for d in decodes))):
        refs.append(len(host) if needed else None)
        if needed:
            host.append(torch.tensor(values, dtype=torch.int64))
    return refs[0], refs[1], refs[2], m, length


def paged_attention(qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int, plan: AttentionPlan,
                    num_heads: int, num_kv_heads: int, kv_written: bool = False) -> torch.Tensor:
    """Write new K/V for ``layer`` into the cache (unless ``kv_written``: the caller stored them), then attend.

    Args:
        qkv: ``[T, num_heads + 2 * num_kv_heads, head_dim]``: queries, keys, values of the new tokens
            (q and k RoPE-rotated); k and v heads are adjacent, so K/V are written without a copy.
        kv_cache: 6-D cache, updated in place at the planned slots.
    Returns:
        ``[T, num_heads * head_dim]`` attention output (softmax scale 1/sqrt(head_dim)).
    """
    t, _, d = qkv.shape
    hq, hkv = num_heads, num_kv_heads
    cache = kv_cache.select(1, layer)  # [N, 2, bs, Hkv, D]
    if not kv_written:
        cache[plan.write_blocks, :, plan.write_offsets] = qkv[:, hq:].view(t, 2, hkv, d)
    q = qkv[:, :hq]
    ip = plan.in_place_decode
    if ip is not None and ip.tokens is None:  # decode-only batch on the CPU kernel (tokens None: every token decodes)
        return paged_decode.paged_decode_attention(q, kv_cache, layer, ip.block_tables, ip.seq_lens).view(t, hq * d)
    if len(plan.decode_groups) == 1 and plan.decode_groups[0].tokens is None and not plan.prefills:
        return _decode(q, cache, plan.decode_groups[0]).view(t, hq * d)  # decode-only batch: no scatter
    out = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
    if ip is not None:
        out[ip.tokens] = paged_decode.paged_decode_attention(q[ip.tokens], kv_cache, layer, ip.block_tables, ip.seq_lens)
    for g in plan.decode_groups:
        if g.tokens is None:
            out[:] = _decode(q, cache, g).squeeze(2)
        else:
            out[g.tokens] = _decode(q[g.tokens], cache, g).squeeze(2)
    for p in plan.prefills:  # 4-D SDPA inputs: 3-D ones took a slower kernel (3-5x at 512 tokens, torch 2.13 CPU)
        qs = q[p.start : p.start + p.qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        if p.blocks is None:  # all context is new: attend over this step's K/V (identical to the cached copy)
            kc = qkv[p.start : p.start + p.qlen, hq : hq + hkv].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
            vc = qkv[p.start : p.start + p.qlen, hq + hkv :].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=True)
        else:
            kc, vc = _gather(cache, p.blocks, p.seq_len)
            if kc.dtype != qs.dtype:  # a 16-bit cache under float32 activations (the CPU kernels): widen (exact)
                kc, vc = kc.to(qs.dtype), vc.to(qs.dtype)
            o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=p.mask, enable_gqa=True)
        out[p.start : p.start + p.qlen] = o[0].transpose(0, 1)
    return out.view(t, hq * d)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-block gather of K and V: ``[B, Hkv, length, D]`` each, for ``blocks`` = B x M block ids."""
    _, _, bs, hkv, d = cache.shape
    m = blocks.numel()
    k = cache[:, 0].index_select(0, blocks).view(-1, m * bs, hkv, d)  # [B, M * bs, Hkv, D]
    v = cache[:, 1].index_select(0, blocks).view(-1, m * bs, hkv, d)
    return k[:, :length].transpose(1, 2), v[:, :length].transpose(1, 2)


def _decode(q: torch.Tensor, cache: torch.Tensor, g: _DecodeGroup) -> torch.Tensor:
    """q: ``[B, Hq, D]`` -> ``[B, Hq, 1, D]``: one query token per sequence over its whole-block context."""
    b, _, bs, hkv, d = q.shape[0], *cache.shape[1:]
    k = cache[:, 0].index_select(0, g.blocks).view(b, g.num_blocks * bs, hkv, d)[:, : g.length].transpose(1, 2)
    v = cache[:, 1].index_select(0, g.blocks).view(b, g.num_blocks * bs, hkv, d)[:, : g.length].transpose(1, 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=g.mask, enable_gqa=True)
