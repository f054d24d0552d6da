"""In-process KV transfer backend for unit tests: same API, registrations and errors as ``ucx``.

Senders live in a process-global registry keyed by their endpoint string; ``fetch`` looks the sender up
and copies tensor slices directly (one copy, segment by segment). There is nothing to cancel: a copy
either happened before ``fetch`` returned or not at all.
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
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import PartialBlock, pack_rows, parts_checksum, plan_rows, segment_rows, unpack_rows
from splitserve.transfer.push import PushResult, PushTable
from splitserve.telemetry.transfer import start_send

__all__ = ["InprocKVReceiver", "InprocKVSender"]

_registry_lock = threading.Lock()
_registry: dict[str, "InprocKVSender"] = {}
_ports = itertools.count(40000)


class InprocKVSender(KVSender):
    def __init__(
        self, kv_cache: torch.Tensor, layout: KVLayout, *, host: str = "127.0.0.1", port: int = 0, corrupt_sends: bool = False,
        push_wait_s: float = 10.0,
    ) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._corrupt_sends = bool(corrupt_sends)
        self._bytes = byte_view(kv_cache)
        self._layout = layout
        self._block_nbytes = layout.block_nbytes
        self._digest = layout_digest(layout)
        self._host = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        self._port = int(port)
        self._endpoint: str | None = None
        self._table = TransferTable(self._num_blocks)
        self.push_table = PushTable(layout.num_layers, push_wait_s, "inproc")
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
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, *, verify_checksum: bool = False) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._verify = bool(verify_checksum)
        self._bytes = byte_view(kv_cache)
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
        src_bytes = sender._bytes
        src_np, dst_np = src_bytes.numpy(), self._bytes.numpy()
        rows = [segment_rows(i, len(segments), head, tail, self._partial.block_size) for i in range(len(segments))]

        def parts(pool: np.ndarray, side: int) -> list[np.ndarray]:  # each segment's bytes in order (side 0: src)
            return [pool[seg[side] * bn : (seg[side] + seg[2]) * bn] if r is None
                    else pack_rows(self._partial, pool, seg[side], r[1], r[0]) for seg, r in zip(segments, rows)]

        expected = parts_checksum(parts(src_np, 0)) if self._verify else None
        flipped = segments[0][0] * bn + (self._partial.nbytes(head) if head else 0) if sender._corrupt_sends else None
        ok = False
        obs = start_send("inproc", transfer_id, sum(n for _s, _d, n in segments))  # child of the caller's span
        staged: list[np.ndarray | None] = []
        try:
            if flipped is not None:  # fault injection: the first byte that moves
                src_bytes[flipped] ^= 0xFF
            for (s, d, n), r in zip(segments, rows):
                if r is None:
                    self._bytes[d * bn : (d + n) * bn].copy_(src_bytes[s * bn : (s + n) * bn])
                staged.append(None if r is None else pack_rows(self._partial, src_np, s, r[1], r[0]))
            ok = True
        finally:
            if flipped is not None:
                src_bytes[flipped] ^= 0xFF
            nbytes = sum(n * bn if r is None else self._partial.nbytes(r[1] - r[0]) for (_s, _d, n), r in zip(segments, rows))
            if ok:
                sender.stats.bytes_sent += nbytes
                sender.stats.transfers_ok += 1
            else:
                sender.stats.transfers_failed += 1
            obs.finish(ok, nbytes, None if ok else "copy failed")
            call_on_done(reg, ok)
        if expected is not None:
            got = parts_checksum([dst_np[d * bn : (d + n) * bn] if p is None else p
                                  for (_s, d, n), p in zip(segments, staged)])
            if got != expected:
                self.stats.checksum_failures += 1
                raise KVChecksumMismatch(f"KV transfer {transfer_id!r} from {endpoint} is corrupted")
        for (_s, d, _n), r, p in zip(segments, rows, staged):
            if p is not None:
                unpack_rows(self._partial, dst_np, d, r[1], p, r[0])
        return nbytes
