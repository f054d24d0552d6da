"""The KV cache as a UCX transfer reads and writes it, on one path (:mod:`splitserve.transfer.paths`).

The cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` is addressed as a flat byte range
(``offset`` and ``nbytes`` in bytes). A transfer asks :class:`KVMemory` for the buffer to hand UCX for a range:

* ``host``: a numpy view of the cache (zero copy);
* ``cuda``: a uint8 torch view of the device cache (ucxx takes it through ``__cuda_array_interface__``; zero copy);
* ``staged``: a host buffer (pinned when CUDA is available) -- filled from the cache before a send
  (:meth:`KVMemory.send_range`), copied into the cache after a receive (:meth:`KVMemory.land`).

Device memory is read only after :meth:`KVMemory.ready` synchronised the current CUDA stream of the cache's device
(the engine writes its KV on that stream, or has synchronised it -- sampling a token does -- before it hands blocks
to a transfer). Everything CUDA-specific runs only when the cache is on a CUDA device, so this module imports and
works on a torch without CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from splitserve.transfer.kv_cache import byte_view
from splitserve.transfer.partial_block import PartialBlock, pack_rows, parts_checksum, unpack_rows

__all__ = ["KVMemory", "as_host", "checksum", "cuda_available", "host_buffer", "sync_device"]


def cuda_available() -> bool:
    """True when torch sees a CUDA device (False on a CPU-only torch; never raises)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - a broken driver counts as none
        return False


def host_buffer(nbytes: int) -> np.ndarray:
    """A flat uint8 host buffer of ``nbytes`` bytes (uninitialised), in pinned memory when CUDA is available (so
    copies to and from a device run at full speed; torch caches pinned allocations)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda_available()).numpy()


def sync_device(device: torch.device) -> None:
    """Wait until the current CUDA stream of ``device`` finished its queued work (its KV writes); no-op on cpu."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def as_host(buf) -> np.ndarray:
    """A buffer's bytes as a flat uint8 numpy array: itself when it is one, else a host copy of a torch tensor."""
    if isinstance(buf, np.ndarray):
        return buf
    return buf.detach().to("cpu").view(torch.uint8).reshape(-1).numpy()


class KVMemory:
    """A KV cache tensor seen as flat bytes on one transfer path.

    Args:
        kv_cache: the contiguous cache (any device; checked by the caller with ``check_cache``).
        geom: the layout's partial-block geometry (packed token rows).
        path: "host", "cuda" or "staged"; "host" needs a CPU cache, "cuda" a CUDA one.

    Raises:
        ValueError: ``path`` does not fit the cache's device.
    """

    __slots__ = ("path", "device", "block_nbytes", "_flat", "_host", "_geom")

    def __init__(self, kv_cache: torch.Tensor, geom: PartialBlock, path: str) -> None:
        kind = kv_cache.device.type
        if not (path == "staged" or (path, kind) in (("host", "cpu"), ("cuda", "cuda"))):
            raise ValueError(f"KV transfer path {path!r} does not fit a KV cache on {kv_cache.device}")
        self.path = path
        self.device = kv_cache.device
        self.block_nbytes = geom.block_nbytes
        self._geom = geom
        self._flat = byte_view(kv_cache)
        self._host = self._flat.numpy() if kind == "cpu" else None

    @property
    def in_place(self) -> bool:
        """True when send/receive buffers are views of the cache itself (not staging copies)."""
        return self.path != "staged"

    def ready(self) -> None:
        """Call before reading device memory for a send: waits for the KV writes queued on the current stream."""
        sync_device(self.device)

    def fence(self):
        """A CUDA event recorded now on the calling thread's current stream of the cache's device (the engine thread
        calls this when it reports KV written; ``event.synchronize()`` later waits for exactly that work), or None for
        a CPU cache."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _view(self, offset: int, nbytes: int):
        if self._host is not None:
            return self._host[offset : offset + nbytes]
        return self._flat[offset : offset + nbytes]

    def send_range(self, offset: int, nbytes: int):
        """The buffer UCX sends for bytes ``[offset, offset + nbytes)`` of the cache (staged: a host copy made now)."""
        view = self._view(offset, nbytes)
        if self.in_place:
            return view
        staged = host_buffer(nbytes)
        if self._host is not None:
            np.copyto(staged, view)
        else:
            torch.from_numpy(staged).copy_(view)
        return staged

    def recv_range(self, offset: int, nbytes: int):
        """The buffer UCX receives bytes ``[offset, offset + nbytes)`` of the cache into; pass it to :meth:`land`
        once the receive completed (and was verified)."""
        return self._view(offset, nbytes) if self.in_place else host_buffer(nbytes)

    def land(self, offset: int, buf) -> None:
        """Make received ``buf`` (from :meth:`recv_range`) the cache's bytes at ``offset`` (staged: copy it in)."""
        if self.in_place:
            return
        view = self._view(offset, buf.nbytes)
        if self._host is not None:
            np.copyto(view, buf)
        else:
            view.copy_(torch.from_numpy(buf))

    def send_blocks(self, start: int, count: int):
        """:meth:`send_range` of blocks ``[start, start + count)``."""
        return self.send_range(start * self.block_nbytes, count * self.block_nbytes)

    def recv_blocks(self, start: int, count: int):
        """:meth:`recv_range` of blocks ``[start, start + count)``."""
        return self.recv_range(start * self.block_nbytes, count * self.block_nbytes)

    def host_blocks(self, start: int, count: int) -> np.ndarray:
        """Blocks ``[start, start + count)`` in host memory: a view on a CPU cache, else a host copy."""
        view = self._view(start * self.block_nbytes, count * self.block_nbytes)
        return view if self._host is not None else as_host(view)

    def gather(self, block_ids: list[int]) -> np.ndarray:
        """A new host buffer (pinned when CUDA is available) holding blocks ``block_ids`` in order (``len(block_ids) *
        block_nbytes`` bytes); reads device memory only after :meth:`ready`."""
        bn = self.block_nbytes
        out = host_buffer(len(block_ids) * bn)
        self.ready()
        for i, b in enumerate(block_ids):
            _copy(out[i * bn : (i + 1) * bn], self._view(b * bn, bn))
        return out

    def pack(self, block_id: int, stop: int, first: int = 0) -> np.ndarray:
        """Token rows ``[first, stop)`` of a block, packed into a new host array (see :func:`pack_rows`)."""
        if self._host is not None:
            return pack_rows(self._geom, self._host, block_id, stop, first)
        return pack_rows(self._geom, self.host_blocks(block_id, 1), 0, stop, first)

    def unpack(self, block_id: int, stop: int, packed: np.ndarray, first: int = 0) -> None:
        """Write packed rows (from :meth:`pack`) into rows ``[first, stop)`` of a block (device: through a host copy
        of the block, whose other rows are written back unchanged)."""
        if self._host is not None:
            unpack_rows(self._geom, self._host, block_id, stop, packed, first)
            return
        block = self.host_blocks(block_id, 1)
        unpack_rows(self._geom, block, 0, stop, packed, first)
        self._view(block_id * self.block_nbytes, self.block_nbytes).copy_(torch.from_numpy(block))

    def flip_byte(self, offset: int) -> None:
        """XOR one byte of the cache with 0xFF (fault injection; a second call restores it)."""
        if self._host is not None:
            self._host[offset] ^= 0xFF
        else:
            self._flat[offset : offset + 1].bitwise_xor_(0xFF)


def _copy(dst, src) -> None:
    """Copy between flat uint8 buffers (numpy arrays or torch tensors of any device)."""
    as_tensor = lambda b: torch.from_numpy(b) if isinstance(b, np.ndarray) else b  # noqa: E731
    as_tensor(dst).copy_(as_tensor(src))


def checksum(parts) -> int:
    """xxh3-64 over the bytes of ``parts`` (numpy arrays or torch tensors of any device), in order."""
    return parts_checksum([as_host(p) for p in parts])
