"""KV layout: what must match between a prefill and a decode worker before KV bytes move.

A plain value (no torch): the router and the KV store use it without loading torch. The KV cache
tensor itself is allocated by :func:`splitserve.transfer.kv_cache.allocate_kv_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

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
        device: where this worker's cache lives, "cpu" or "cuda" (the device *kind*; "" when the peer did not say).

    What must match across workers (:meth:`check_compatible`, and the layout digest of every UCX request): every
    field but ``device`` -- the bytes of a block mean the same thing only with the same model, layers, kv heads,
    head_dim, block_size and dtype. ``device`` may differ: a cpu prefill worker can feed a cuda decode worker (UCX
    or the host staging path converts between memory types; :mod:`splitserve.transfer.paths`). So ``device`` is
    left out of equality, hashing, :meth:`describe` and the digest.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    device: str = field(default="cpu", compare=False)

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

    def on_device(self, device_kind: str) -> "KVLayout":
        """This layout with ``device`` set (e.g. from the KV cache tensor: ``kv_cache.device.type``)."""
        return replace(self, device=device_kind)

    def mismatched_fields(self, remote: "KVLayout") -> list[str]:
        """Names of the fields that must match but differ (empty: KV can move between the two)."""
        return [f.name for f in fields(self) if f.compare and getattr(self, f.name) != getattr(remote, f.name)]

    def check_compatible(self, remote: "KVLayout") -> None:
        """Raise KVLayoutMismatch (naming the differing fields and both layouts, devices included) unless ``remote``
        matches this layout in every field but ``device``."""
        bad = self.mismatched_fields(remote)
        if bad:
            raise KVLayoutMismatch(
                f"KV layout mismatch ({', '.join(bad)} differ; the device may differ, nothing else): local "
                f"[{self.describe()} device={self.device or '?'}] vs remote [{remote.describe()} device={remote.device or '?'}]")
