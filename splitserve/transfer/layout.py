"""KV layout: what must match between a prefill and a decode worker before KV bytes move."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.errors import KVLayoutMismatch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        dtype: "float32", "float16" or "bfloat16".
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one KV block: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one KV block across all layers, K and V."""
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * torch.tensor([], dtype=self.torch_dtype).element_size()

    def describe(self) -> str:
        return (
            f"model={self.model_id} layers={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} block_size={self.block_size} dtype={self.dtype}"
        )

    def check_compatible(self, remote: "KVLayout") -> None:
        """Raise KVLayoutMismatch (names both layouts) unless ``remote`` equals this layout."""
        if remote != self:
            raise KVLayoutMismatch(f"KV layout mismatch: local [{self.describe()}] vs remote [{remote.describe()}]")

    def allocate_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeroed KV cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return torch.zeros((num_blocks, *self.block_shape), dtype=self.torch_dtype)
