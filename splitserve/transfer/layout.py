"""KV layout: what must match between a prefill and a decode worker before KV bytes move.

A plain value (no torch): the router and the KV store use it without loading torch. The KV cache
tensor itself is allocated by :func:`splitserve.transfer.kv_cache.allocate_kv_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.dtypes import itemsize
from splitserve.errors import KVLayoutMismatch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one worker's paged KV cache.

    The cache is one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
    (block-major: the K and V of all layers for one KV block are contiguous), so a run of
    consecutive block ids is one contiguous byte range that UCX can move in one message.

    Attributes:
        model_id: model identity (name plus a digest of its config), never a path.
        num_layers, num_kv_heads, head_dim: from the model config.
        block_size: tokens per KV block.
        dtype: a name of :data:`splitserve.dtypes.DTYPE_ITEMSIZE` ("float32", "float16", "bfloat16", ...).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one KV block: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one KV block across all layers, K and V. Raises ValueError for an unknown dtype."""
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * itemsize(self.dtype)

    def describe(self) -> str:
        return (
            f"model={self.model_id} layers={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} block_size={self.block_size} dtype={self.dtype}"
        )

    def check_compatible(self, remote: "KVLayout") -> None:
        """Raise KVLayoutMismatch (names both layouts) unless ``remote`` equals this layout."""
        if remote != self:
            raise KVLayoutMismatch(f"KV layout mismatch: local [{self.describe()}] vs remote [{remote.describe()}]")
