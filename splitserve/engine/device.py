"""The compute device of an engine (``--device cpu|cuda|cuda:N``): checks, the KV cache on it, stream sync.

:func:`check_device` is torch-free (configs and ``splitserve up`` use it); the others import torch when
called. Nothing here touches CUDA unless a CUDA device is asked for, so importing it on a machine without
a GPU (or with a CPU-only torch) is harmless.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from splitserve.transfer.layout import KVLayout

DEVICE_HELP = "cpu (default), cuda (GPU 0) or cuda:N"
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str) -> str:
    """``device`` itself if it is spelled ``cpu``, ``cuda`` or ``cuda:N`` (N >= 0), without looking for a GPU.

    Raises:
        ValueError: "--device must be cpu, cuda or cuda:N, got 'tpu'".
    """
    if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    return device


def check_device_available(device: str) -> str:
    """``device`` itself if this process can compute on it: cpu always; cuda / cuda:N when torch sees a CUDA
    GPU with that index.

    Raises:
        ValueError: a bad spelling (:func:`check_device`), no CUDA here (CPU-only torch build or no GPU
            visible), or an index out of range; one line naming the flag.
    """
    check_device(device)
    if device == "cpu":
        return device  # no torch import: the control plane checks cpu workers' settings too
    import torch

    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
        raise ValueError(f"--device {device}: CUDA is not available here ({why}); use --device cpu")
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device {device}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    return device


def allocate_kv_cache_on(layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor:
    """Zeroed KV cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the layout's dtype
    on ``device`` (:func:`splitserve.transfer.kv_cache.allocate_kv_cache`, the transfer layer's own)."""
    from splitserve.transfer.kv_cache import allocate_kv_cache

    return allocate_kv_cache(layout, num_blocks, device)


def synchronize(device: torch.device | str) -> None:
    """Wait until every kernel queued on ``device``'s default stream (where engine steps run) has finished, so its
    KV blocks may be read by another component (a UCX send, a store write); no-op on cpu. Any thread may call it."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.default_stream(dev).synchronize()
