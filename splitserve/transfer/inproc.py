"""In-process KV transfer backend for unit tests: same API, registrations and errors as ``ucx``.

Senders live in a process-global registry keyed by their endpoint string; ``fetch`` looks the sender up
and copies tensor slices directly (one copy, segment by segment). There is nothing to cancel: a copy
either happened before ``fetch`` returned or not at all. Pools may be in host or CUDA memory (torch copies between
them); ``staging="always"`` routes every copy through host staging buffers like the UCX ``staged`` path
(:mod:`splitserve.transfer.paths`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import numpy as np
import torch

from splitserve.errors import InvalidRequest, KVChecksumMismatch, KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.transfer.base import KVReceiver, KVSender, OnDone, TransferRefused, TransferStats
from splitserve.transfer.common import (
    Status,
    TransferTable,
    call_on_done,
    compute_segments,
    format_endpoint,
    layout_digest,
    parse_endpoint,
)
from splitserve.transfer.kv_cache import byte_view, check_cache
from splitserve.transfer.kv_memory import KVMemory, as_host, checksum as parts_checksum
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import PartialBlock, plan_rows, segment_rows
from splitserve.transfer.paths import CUDA_TRANSPORTS, check_staging, choose_path, staging_from_env
from splitserve.transfer.push import PushResult, PushTable
from splitserve.telemetry.transfer import start_send

__all__ = ["InprocKVReceiver", "InprocKVSender"]

_registry_lock = threading.Lock()
_registry: dict[str, "InprocKVSender"] = {}
_ports = itertools.count(40000)


def _memory(kv_cache: torch.Tensor, layout: KVLayout, staging: str | None) -> KVMemory:
    """The pool on its path: torch copies reach CUDA memory directly, so staging is used only when forced."""
    staging = staging_from_env() if staging is None else check_staging(staging)
    return KVMemory(kv_cache, PartialBlock(layout), choose_path(kv_cache.device.type, CUDA_TRANSPORTS, staging))


def as_host_copy(buf) -> np.ndarray:
    """A private host copy of a buffer's bytes (flat uint8)."""
    return np.array(as_host(buf), copy=True)


def _copy_into(dst, src) -> None:
    """Copy ``src`` into ``dst`` (flat uint8 numpy arrays or torch tensors, any devices; equal sizes)."""
    as_tensor = lambda b: torch.from_numpy(b) if isinstance(b, np.ndarray) else b  # noqa: E731
    as_tensor(dst).copy_(as_tensor(src))


class InprocKVSender(KVSender):
    def __init__(
        self, kv_cache: torch.Tensor, layout: KVLayout, *, host: str = "127.0.0.1", port: int = 0, corrupt_sends: bool = False,
        push_wait_s: float = 10.0, staging: str | None = None,
    ) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._corrupt_sends = bool(corrupt_sends)
        self._bytes = byte_view(kv_cache)
        self._mem = _memory(kv_cache, layout, staging)
        self.path = self._mem.path
        self._layout = layout
        self._block_nbytes = layout.block_nbytes
        self._digest = layout_digest(layout)
        self._host = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        self._port = int(port)
        self._endpoint: str | None = None
        self._table = TransferTable(self._num_blocks)
        self.push_table = PushTable(layout.num_layers, push_wait_s, "inproc")
        self.push_table.path, self.push_table.fence = self.path, self._mem.fence
        self._closed = False
        self.stats = TransferStats()

    async def start(self) -> None:
        if self._endpoint is not None:
            return
        if self._closed:
            raise RuntimeError("sender is closed")
        with _registry_lock:
            if self._port == 0:
                while True:
                    candidate = format_endpoint(self._host, next(_ports))
                    if candidate not in _registry:
                        break
            else:
                candidate = format_endpoint(self._host, self._port)
                if candidate in _registry:
                    raise OSError(f"inproc KV endpoint {candidate} is already in use")
            _registry[candidate] = self
            self._endpoint = candidate

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("endpoint is known only after start()")
        return self._endpoint

    def register(self, transfer_id: str, block_ids: list[int], on_done: OnDone) -> None:
        if self._closed:
            raise RuntimeError("sender is closed")
        self._table.register(transfer_id, block_ids, on_done)

    def unregister(self, transfer_id: str) -> bool:
        return self._table.unregister(transfer_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _registry_lock:
            if self._endpoint is not None and _registry.get(self._endpoint) is self:
                del _registry[self._endpoint]
        self.push_table.fail_all("KV sender is closing")
        for reg in self._table.drain():
            self.stats.transfers_failed += 1
            call_on_done(reg, False)


class InprocKVReceiver(KVReceiver):
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, *, verify_checksum: bool = False,
                 staging: str | None = None) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._verify = bool(verify_checksum)
        self._bytes = byte_view(kv_cache)
        self._mem = _memory(kv_cache, layout, staging)
        self.path = self._mem.path
        self._block_nbytes = layout.block_nbytes
        self._partial = PartialBlock(layout)
        self._digest = layout_digest(layout)
        self._started = False
        self._closed = False
        self.stats = TransferStats()

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("receiver is closed")
        self._started = True

    async def close(self) -> None:
        self._closed = True

    async def receive_push(self, endpoint: str, bootstrap_id: str, dst_block_ids: list[int], layer_groups: int,
                           timeout_s: float) -> PushResult:
        from splitserve.transfer.inproc_push import receive_push

        if self._closed:
            raise KVTransferError("receiver is closed")
        compute_segments(dst_block_ids, dst_block_ids, self._num_blocks)  # range and duplicate checks
        if timeout_s <= 0:
            raise InvalidRequest("timeout_s must be positive")
        parse_endpoint(endpoint)
        with _registry_lock:
            sender = _registry.get(endpoint)
        try:
            if sender is None or sender._closed:
                raise KVTransferError(f"no inproc KV sender at {endpoint}")
            result = await receive_push(sender, self, endpoint, bootstrap_id, dst_block_ids, layer_groups, timeout_s)
        except BaseException:
            self.stats.transfers_failed += 1
            raise
        self.stats.bytes_received += result.nbytes
        sender.stats.bytes_sent += result.nbytes
        self.stats.transfers_ok += 1
        sender.stats.transfers_ok += 1
        return result

    async def fetch(
        self,
        endpoint: str,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        timeout_s: float,
        last_block_tokens: int = 0,
        first_block_held: int = 0,
    ) -> int:
        if self._closed:
            raise KVTransferError("receiver is closed")
        if not self._started:
            raise RuntimeError("receiver not started")
        segments = compute_segments(src_block_ids, dst_block_ids, self._num_blocks)
        if not segments:
            return 0
        segments, tail, head = plan_rows(self._partial, segments, last_block_tokens, first_block_held)
        if timeout_s <= 0:
            raise InvalidRequest("timeout_s must be positive")
        parse_endpoint(endpoint)
        try:
            nbytes = self._copy(endpoint, transfer_id, segments, tail, head)
        except BaseException:
            self.stats.transfers_failed += 1
            raise
        self.stats.bytes_received += nbytes
        self.stats.transfers_ok += 1
        await asyncio.sleep(0)
        return nbytes

    def _copy(self, endpoint: str, transfer_id: str, segments, tail: int, head: int) -> int:
        """Copy ``segments`` from the sender's pool; a partial last block (``tail`` > 0: rows [0, tail)) and a partly
        held first block (``head`` > 0: rows [head, ...)) move packed, like the UCX path."""
        with _registry_lock:
            sender = _registry.get(endpoint)
        if sender is None or sender._closed:  # same module
            raise KVTransferError(f"no inproc KV sender at {endpoint}")
        if sender._block_nbytes != self._block_nbytes or sender._digest != self._digest:
            raise KVLayoutMismatch(f"KV layout mismatch with sender {endpoint}: remote [{sender._layout.describe()}]")
        status, reg, detail = sender._table.claim(transfer_id, [(s, n) for s, _d, n in segments])
        if status is Status.NOT_FOUND:
            raise TransferNotFound(detail)
        if status is not Status.OK:
            raise TransferRefused(f"KV sender {endpoint} refused transfer {transfer_id!r}: {detail}")
        bn = self._block_nbytes
        src_mem, dst_mem = sender._mem, self._mem
        rows = [segment_rows(i, len(segments), head, tail, self._partial.block_size) for i in range(len(segments))]
        ok = False
        obs = start_send("inproc", transfer_id, sum(n for _s, _d, n in segments), path=src_mem.path)  # child of the caller's span
        received: list = []  # where each segment landed (a view of the pool, a staging buffer or packed rows)
        expected = None
        try:
            src_mem.ready()
            sent = [src_mem.send_blocks(s, n) if r is None else src_mem.pack(s, r[1], r[0]) for (s, _d, n), r in zip(segments, rows)]
            expected = parts_checksum(sent) if self._verify else None
            if sender._corrupt_sends:  # fault injection: the first byte that moves, in a private copy
                sent[0] = as_host_copy(sent[0])
                sent[0][0] ^= 0xFF
            for (_s, d, n), r, part in zip(segments, rows, sent):
                received.append(dst_mem.recv_blocks(d, n) if r is None else np.empty(part.nbytes, np.uint8))
                _copy_into(received[-1], part)
            ok = True
        finally:
            nbytes = sum(n * bn if r is None else self._partial.nbytes(r[1] - r[0]) for (_s, _d, n), r in zip(segments, rows))
            if ok:
                sender.stats.bytes_sent += nbytes
                sender.stats.transfers_ok += 1
            else:
                sender.stats.transfers_failed += 1
            obs.finish(ok, nbytes, None if ok else "copy failed")
            call_on_done(reg, ok)
        if expected is not None and parts_checksum(received) != expected:
            self.stats.checksum_failures += 1
            raise KVChecksumMismatch(f"KV transfer {transfer_id!r} from {endpoint} is corrupted")
        for (_s, d, _n), r, part in zip(segments, rows, received):
            if r is None:
                dst_mem.land(d * bn, part)
            else:
                dst_mem.unpack(d, r[1], part, r[0])
        return nbytes
