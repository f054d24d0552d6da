"""The used token rows of a partial KV block: what a pull moves of a prompt's last block.

A prompt of ``n`` tokens fills ``n // block_size`` KV blocks and, when ``n % block_size`` is not 0, the first
``t = n % block_size`` token rows of one more block. Only those rows hold KV, so a pull moves only them: in
the cache layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` the rows ``[0, t)`` of
one block are ``2 * num_layers`` strided runs; the sender packs them into one contiguous staging buffer
``[num_layers, 2, t, num_kv_heads * head_dim * itemsize]`` (uint8) that travels as one message, and the
receiver unpacks it into its block. Rows ``[t, block_size)`` of the destination block are left as they were
(attention never reads past the sequence length).

Works on the pool as a flat uint8 numpy array (:func:`splitserve.transfer.kv_cache.byte_view`), so neither
side needs the dtype.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from splitserve.errors import InvalidRequest
from splitserve.transfer.layout import KVLayout

__all__ = ["PartialBlock", "pack_rows", "split_tail", "transfer_checksum", "unpack_rows"]


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

    def rows(self, pool: np.ndarray, block_id: int, num_tokens: int) -> np.ndarray:
        """Strided view ``[num_layers, 2, num_tokens, row_nbytes]`` (uint8) of rows ``[0, num_tokens)`` of block
        ``block_id`` of the flat uint8 ``pool``."""
        block = pool[block_id * self.block_nbytes : (block_id + 1) * self.block_nbytes].reshape(self._shape)
        return block[:, :, :num_tokens]


def pack_rows(geom: PartialBlock, pool: np.ndarray, block_id: int, num_tokens: int) -> np.ndarray:
    """A contiguous copy (flat uint8, ``geom.nbytes(num_tokens)`` bytes) of rows ``[0, num_tokens)`` of a block."""
    return np.ascontiguousarray(geom.rows(pool, block_id, num_tokens)).reshape(-1)


def unpack_rows(geom: PartialBlock, pool: np.ndarray, block_id: int, num_tokens: int, packed: np.ndarray) -> None:
    """Write ``packed`` (from :func:`pack_rows`) into rows ``[0, num_tokens)`` of block ``block_id`` of ``pool``.

    Raises:
        ValueError: ``packed`` does not hold exactly ``geom.nbytes(num_tokens)`` bytes.
    """
    if packed.size != geom.nbytes(num_tokens):
        raise ValueError(f"packed rows hold {packed.size} bytes, expected {geom.nbytes(num_tokens)}")
    view = geom.rows(pool, block_id, num_tokens)
    view[...] = packed.reshape(view.shape)


def split_tail(segments: list[tuple[int, int, int]], tail_rows: int) -> list[tuple[int, int, int]]:
    """Segments ``(src_start, dst_start, count)`` with the last block taken out of the last run into a run of
    its own (moved as ``tail_rows`` packed rows). ``tail_rows`` 0: unchanged."""
    if not tail_rows or not segments:
        return segments
    s, d, n = segments[-1]
    head = segments[:-1] + ([(s, d, n - 1)] if n > 1 else [])
    return head + [(s + n - 1, d + n - 1, 1)]


def transfer_checksum(pool: np.ndarray, runs: Sequence[tuple[int, int]], block_nbytes: int,
                      tail: np.ndarray | None = None) -> int:
    """xxh3-64 over exactly the bytes a transfer moves, in order: blocks ``[start, start + count)`` of each
    run of the flat uint8 ``pool``, then the packed rows ``tail`` of a partial last block (None: none; then
    ``runs`` is every run of the transfer)."""
    h = xxhash.xxh3_64()
    for start, count in runs:
        h.update(pool[start * block_nbytes : (start + count) * block_nbytes])
    if tail is not None:
        h.update(tail)
    return h.intdigest()
