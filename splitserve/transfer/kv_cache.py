"""The KV cache tensor of a :class:`KVLayout`: torch dtype, allocation and checks.

The torch side of the layout; :mod:`splitserve.transfer.layout` itself stays torch-free so the
control plane can use it. The cache is one contiguous tensor (host or CUDA memory)
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the layout's dtype.
"""

from __future__ import annotations

import torch

from splitserve.dtypes import itemsize
from splitserve.transfer.layout import KVLayout


def torch_dtype(dtype: str) -> torch.dtype:
    """The ``torch.dtype`` of a dtype name of :data:`splitserve.dtypes.DTYPE_ITEMSIZE`.

    Raises:
        ValueError: unknown name.
    """
    itemsize(dtype)  # validates the name
    return getattr(torch, dtype)


def allocate_kv_cache(layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Zeroed KV cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the layout's dtype, on
    ``device``."""
    return torch.zeros((num_blocks, *layout.block_shape), dtype=torch_dtype(layout.dtype), device=device)


def check_cache(kv_cache: torch.Tensor, layout: KVLayout) -> int:
    """Validate that ``kv_cache`` is the layout's contiguous pool (on cpu or a cuda device); return its number of blocks.

    Raises:
        TypeError: not a tensor.
        ValueError: wrong device, shape, dtype, or not contiguous.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError("kv_cache must be a torch.Tensor")
    if kv_cache.device.type not in ("cpu", "cuda"):
        # transfers hand ucxx numpy views of host memory or torch views of CUDA memory (splitserve.transfer.kv_memory)
        raise ValueError(f"kv_cache must be in host or CUDA memory, got device {kv_cache.device}")
    if tuple(kv_cache.shape[1:]) != layout.block_shape or kv_cache.dim() != 6:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not match layout [{layout.describe()}]")
    if kv_cache.dtype != torch_dtype(layout.dtype):
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} does not match layout dtype {layout.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (one block-major allocation)")
    return int(kv_cache.shape[0])


def byte_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The whole cache as a flat uint8 tensor sharing its memory."""
    return kv_cache.view(-1).view(torch.uint8)
