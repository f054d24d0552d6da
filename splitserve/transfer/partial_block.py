"""The used token rows of a partial KV block: what a pull moves of a prompt's last block.

A prompt of ``n`` tokens fills ``n // block_size`` KV blocks and, when ``n % block_size`` is not 0, the first
``t = n % block_size`` token rows of one more block. Only those rows hold KV, so a pull moves only them: in
the cache layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` the rows ``[0, t)`` of
one block are ``2 * num_layers`` strided runs; the sender packs them into one contiguous staging buffer
``[num_layers, 2, t, num_kv_heads * head_dim * itemsize]`` (uint8) that travels as one message, and the
receiver unpacks it into its block. Rows ``[t, block_size)`` of the destination block are left as they were
(attention never reads past the sequence length).

The mirror case, a partly held FIRST block: a decode worker that already holds a block's first ``r`` token rows
(a previous turn's partial block, copied from its prefix cache) pulls only rows ``[r, block_size)`` of it (or
``[r, t)`` when it is also the prompt's partial last block). A transfer is then a list of segments of which the
first and the last may each be one block moved as packed rows (:func:`segment_rows`).

Works on the pool as a flat uint8 numpy array (:func:`splitserve.transfer.kv_cache.byte_view`), so neither
side needs the dtype.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from splitserve.errors import InvalidRequest
from splitserve.transfer.layout import KVLayout

__all__ = ["PartialBlock", "pack_rows", "parts_checksum", "plan_rows", "segment_rows", "split_head", "split_tail",
           "unpack_rows"]


class PartialBlock:
    """Geometry of the used rows of one block of a layout's pool.

    Attributes:
        block_size: tokens per KV block.
        token_nbytes: bytes of one token's K and V across all layers (``block_nbytes // block_size``).
    """

    __slots__ = ("_shape", "block_size", "block_nbytes", "token_nbytes")

    def __init__(self, layout: KVLayout) -> None:
        self.block_size = layout.block_size
        self.block_nbytes = layout.block_nbytes
        self.token_nbytes = self.block_nbytes // layout.block_size
        row = self.block_nbytes // (layout.num_layers * 2 * layout.block_size)  # one token of one layer's K or V
        self._shape = (layout.num_layers, 2, layout.block_size, row)

    def check_rows(self, num_tokens: int) -> None:
        """Raise InvalidRequest unless ``0 < num_tokens < block_size`` (a partial block's used rows)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 < num_tokens < self.block_size:
            raise InvalidRequest(f"partial block rows {num_tokens!r} out of range (0, {self.block_size})")

    def nbytes(self, num_tokens: int) -> int:
        """Bytes that rows ``[0, num_tokens)`` of one block take on the wire."""
        return num_tokens * self.token_nbytes

    def rows(self, pool: np.ndarray, block_id: int, num_tokens: int, first: int = 0) -> np.ndarray:
        """Strided view ``[num_layers, 2, num_tokens - first, row_nbytes]`` (uint8) of rows ``[first, num_tokens)``
        of block ``block_id`` of the flat uint8 ``pool``."""
        block = pool[block_id * self.block_nbytes : (block_id + 1) * self.block_nbytes].reshape(self._shape)
        return block[:, :, first:num_tokens]


def pack_rows(geom: PartialBlock, pool: np.ndarray, block_id: int, num_tokens: int, first: int = 0) -> np.ndarray:
    """A contiguous copy (flat uint8, ``geom.nbytes(num_tokens - first)`` bytes) of rows ``[first, num_tokens)``
    of a block."""
    return np.ascontiguousarray(geom.rows(pool, block_id, num_tokens, first)).reshape(-1)


def unpack_rows(geom: PartialBlock, pool: np.ndarray, block_id: int, num_tokens: int, packed: np.ndarray,
                first: int = 0) -> None:
    """Write ``packed`` (from :func:`pack_rows`) into rows ``[first, num_tokens)`` of block ``block_id`` of ``pool``.

    Raises:
        ValueError: ``packed`` does not hold exactly ``geom.nbytes(num_tokens - first)`` bytes.
    """
    if packed.size != geom.nbytes(num_tokens - first):
        raise ValueError(f"packed rows hold {packed.size} bytes, expected {geom.nbytes(num_tokens - first)}")
    view = geom.rows(pool, block_id, num_tokens, first)
    view[...] = packed.reshape(view.shape)


def segment_rows(i: int, num_segments: int, head_rows: int, tail_rows: int, block_size: int) -> tuple[int, int] | None:
    """Token rows ``(first, stop)`` that segment ``i`` of a transfer moves packed, or None when it moves whole
    blocks: the first segment starts at ``head_rows`` (> 0: a partly held first block), the last one stops at
    ``tail_rows`` (> 0: a partial last block); both are then one block."""
    first = head_rows if i == 0 else 0
    stop = tail_rows if tail_rows and i == num_segments - 1 else block_size
    return None if (first, stop) == (0, block_size) else (first, stop)


def split_head(segments: list[tuple[int, int, int]], head_rows: int) -> list[tuple[int, int, int]]:
    """Segments ``(src_start, dst_start, count)`` with the first block taken out of the first run into a run of
    its own (moved as packed rows ``[head_rows, ...)``). ``head_rows`` 0: unchanged."""
    if not head_rows or not segments:
        return segments
    s, d, n = segments[0]
    return [(s, d, 1)] + ([(s + 1, d + 1, n - 1)] if n > 1 else []) + segments[1:]


def plan_rows(geom: PartialBlock, segments: list[tuple[int, int, int]], last_block_tokens: int,
              first_block_held: int) -> tuple[list[tuple[int, int, int]], int, int]:
    """A fetch's segments with its partial blocks in runs of their own; returns ``(segments, tail_rows, head_rows)``.

    ``last_block_tokens``: tokens of the last block (0 or ``block_size``: whole); ``first_block_held``: token rows
    the destination's first block already holds (0: none). Raises InvalidRequest when either is out of
    ``[0, block_size)`` (``last_block_tokens`` may be ``block_size``) or the only block has no rows left to move."""
    tail = 0 if last_block_tokens == geom.block_size else last_block_tokens
    if tail:
        geom.check_rows(tail)
    if first_block_held:
        geom.check_rows(first_block_held)
        if sum(n for _s, _d, n in segments) == 1 and tail and first_block_held >= tail:
            raise InvalidRequest(f"first block holds {first_block_held} of its {tail} rows: nothing to move")
    return split_head(split_tail(segments, tail), first_block_held), tail, first_block_held


def parts_checksum(parts: Sequence[np.ndarray]) -> int:
    """xxh3-64 over the flat uint8 arrays ``parts``, in order (the bytes of a transfer's segments)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def split_tail(segments: list[tuple[int, int, int]], tail_rows: int) -> list[tuple[int, int, int]]:
    """Segments ``(src_start, dst_start, count)`` with the last block taken out of the last run into a run of
    its own (moved as ``tail_rows`` packed rows). ``tail_rows`` 0: unchanged."""
    if not tail_rows or not segments:
        return segments
    s, d, n = segments[-1]
    head = segments[:-1] + ([(s, d, n - 1)] if n > 1 else [])
    return head + [(s + n - 1, d + n - 1, 1)]
