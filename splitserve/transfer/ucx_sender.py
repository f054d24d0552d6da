"""The prefill side of the UCX KV transfer: serves FETCH requests for registered blocks of its KV pool.

Protocol and failure handling: :mod:`splitserve.transfer.ucx`. Connections come from a
:class:`~splitserve.transfer.ucx_listener.UcxServer`; each FETCH is answered at once (the STATUS and every
segment posted straight from the pool) and its completion awaited in a task of that connection.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import torch

from splitserve.telemetry.transfer import start_send
from splitserve.transfer import ucx_runtime
from splitserve.transfer import push_wire, wire
from splitserve.transfer.base import KVSender, OnDone, TransferStats
from splitserve.transfer.common import (
    Registration,
    Status,
    TransferTable,
    advertise_host,
    call_on_done,
    format_endpoint,
    layout_digest,
)
from splitserve.transfer.kv_cache import check_cache
from splitserve.transfer.kv_memory import KVMemory, checksum as parts_checksum
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import PartialBlock, segment_rows
from splitserve.transfer.paths import check_staging, choose_path, staging_from_env
from splitserve.transfer.push import PushTable
from splitserve.transfer.ucx_listener import UcxServer
from splitserve.transfer.ucx_push import UcxSubscriber
from splitserve.transfer.ucx_requests import Posted

logger = logging.getLogger("splitserve.transfer.ucx")

_EMPTY = np.empty(0, dtype=np.uint8)


class UcxKVSender(KVSender):
    """Serves pulls of registered blocks of ``kv_cache`` (host or CUDA memory) over a ucxx listener.

    ``staging``: "auto" | "always" | "never" (None: ``PD_KV_TRANSFER_STAGING``); the path
    (:mod:`splitserve.transfer.paths`) is decided at :meth:`start` from the cache's device and UCX's transports
    and is then :attr:`path`. Raises ValueError on a bad ``staging`` (at construction) or an impossible path (at
    :meth:`start`)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        send_timeout_s: float = 30.0,
        corrupt_sends: bool = False,
        push_wait_s: float = 10.0,
        staging: str | None = None,
    ) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._corrupt_sends = bool(corrupt_sends)  # fault injection for tests (splitserve.transfer.faults)
        self._kv = kv_cache
        self._staging = staging_from_env() if staging is None else check_staging(staging)
        self._mem: KVMemory | None = None  # at start(), on the chosen path
        self._block_nbytes = layout.block_nbytes
        self._digest = layout_digest(layout)
        self._layout = layout
        self._partial = PartialBlock(layout)
        self._host = advertise_host(host)
        self._send_timeout_s = float(send_timeout_s)
        self._table = TransferTable(self._num_blocks)
        self.push_table = PushTable(layout.num_layers, push_wait_s)
        self._server = UcxServer(self._dispatch, push_wire.decode_request, port=port, name="KV sender", drain_s=self._send_timeout_s)
        self.stats = TransferStats()

    # ---------------------------------------------------------------- API
    async def start(self) -> None:
        if self._server.started:
            return
        await self._server.start()
        try:
            path = choose_path(self._kv.device.type, ucx_runtime.transports(), self._staging)
        except ValueError:
            await self._server.close(drain_s=0.0)
            raise
        self._mem = KVMemory(self._kv, self._partial, path)
        self.push_table.path = path
        self.push_table.fence = self._mem.fence
        logger.info("KV sender listening, advertised as %s (KV path %s, cache on %s)", self.endpoint, path, self._kv.device)

    @property
    def path(self) -> str:
        """"host", "cuda" or "staged" (:mod:`splitserve.transfer.paths`); known after :meth:`start`."""
        if self._mem is None:
            raise RuntimeError("the KV path is known only after start()")
        return self._mem.path

    @property
    def endpoint(self) -> str:
        if not self._server.started and self._server.port == 0:
            raise RuntimeError("endpoint is known only after start()")
        return format_endpoint(self._host, self._server.port)

    def register(self, transfer_id: str, block_ids: list[int], on_done: OnDone) -> None:
        if self._server.closing:
            raise RuntimeError("sender is closed")
        self._table.register(transfer_id, block_ids, on_done)

    def unregister(self, transfer_id: str) -> bool:
        return self._table.unregister(transfer_id)

    async def close(self) -> None:
        if self._server.closing:
            return
        # Transfers already being sent usually complete within milliseconds: let them report success;
        # then aborting the connections cancels what is still posted.
        self.push_table.fail_all("KV sender is closing")
        await self._server.close(drain_s=1.0)
        for reg in self._table.drain():
            self.stats.transfers_failed += 1
            call_on_done(reg, False)

    # ---------------------------------------------------------------- requests
    def _dispatch(self, ep, req: wire.FetchRequest | push_wire.SubscribeRequest) -> bool:
        """Answer one FETCH request, or file one push subscription; False means the connection failed and is dropped."""
        if isinstance(req, push_wire.SubscribeRequest):
            return self._subscribe(ep, req)
        reg: Registration | None = None
        mem = self._mem
        obs = start_send("ucx", req.transfer_id, sum(n for _s, n in req.runs), req.trace_context, path=mem.path)
        if self._server.closing:
            status, detail = Status.CLOSING, "sender is closing"
        elif req.block_nbytes != self._block_nbytes or req.layout_digest != self._digest:
            status, detail = Status.LAYOUT_MISMATCH, self._layout.describe()
        elif req.tail_rows >= self._partial.block_size or req.head_rows >= self._partial.block_size:
            status, detail = Status.INVALID, (f"partial rows [{req.head_rows}, {req.tail_rows}) in blocks of "
                                              f"{self._partial.block_size}")
        else:
            # Serves only blocks registered under this id (registered ids are range-checked).
            status, reg, detail = self._table.claim(req.transfer_id, req.runs)
        # Post the STATUS and every segment now (no loop hop before the bytes start moving).
        bs = self._partial.block_size
        nbytes = 0
        checksum = None
        parts = []  # the bytes of each segment, in tag order (a partly held first / partial last block: packed rows)
        if status is Status.OK:
            mem.ready()  # device memory: the KV writes queued on the stream are done
            for i, (start, count) in enumerate(req.runs):
                rows = segment_rows(i, len(req.runs), req.head_rows, req.tail_rows, bs)
                parts.append(mem.send_blocks(start, count) if rows is None else mem.pack(start, rows[1], rows[0]))
            nbytes = sum(p.nbytes for p in parts)
            if req.flags & wire.FLAG_CHECKSUM:
                checksum = parts_checksum(parts)
        corrupted = None
        if status is Status.OK and self._corrupt_sends:  # fault injection, after the checksum
            packed = segment_rows(0, len(req.runs), req.head_rows, req.tail_rows, bs) is not None
            if packed or not mem.in_place:  # a private host copy
                parts[0][0] ^= 0xFF
            else:
                corrupted = self._corrupt(req.runs)
        posted: Posted | None = None
        error: BaseException | None = None
        try:
            posted = Posted(ep)
            posted.send(wire.encode_status(status, detail, checksum), req.tag_base)
            for i in range(len(req.runs)):
                # not OK: an empty message completes the receiver's posted receive without writing into its blocks
                posted.send(parts[i] if parts else _EMPTY, req.tag_base + 1 + i)
        except Exception as exc:  # endpoint closed or failed while posting
            error = exc
        refusal = None if status is Status.OK else f"{status.name}: {detail}"
        self._server.spawn(ep, self._finish(ep, req.transfer_id, posted, error, reg, nbytes, obs, refusal, corrupted))
        return error is None

    def _subscribe(self, ep, req: push_wire.SubscribeRequest) -> bool:
        sub = UcxSubscriber(ep, self._server.forget, self._mem, self._block_nbytes, self._layout.num_layers, req)
        try:
            if self._server.closing:
                self.push_table.reject(sub, "sender is closing", Status.CLOSING)
            elif req.block_nbytes != self._block_nbytes or req.layout_digest != self._digest:
                self.push_table.reject(sub, self._layout.describe(), Status.LAYOUT_MISMATCH)
            else:
                self.push_table.subscribe(req.bootstrap_id, sub)
        except Exception as exc:  # the endpoint failed while posting
            logger.info("KV push subscription %s: connection failed: %r", req.bootstrap_id, exc)
            return False
        return True

    def _corrupt(self, runs) -> int:
        """Fault injection: flip the first byte of the first requested block; returns its offset."""
        offset = runs[0][0] * self._block_nbytes
        self._mem.flip_byte(offset)
        return offset

    async def _finish(self, ep, transfer_id: str, posted: Posted | None, error: BaseException | None,
                      reg: Registration | None, nbytes: int, obs, refusal: str | None, corrupted: int | None = None) -> None:
        """Wait for the posted sends, then report the transfer exactly once (and end its span)."""
        ok = False
        try:
            if posted is None:  # the endpoint failed before anything was posted
                self._server.forget(ep)
            else:
                # Sends still posted after the timeout (or on a failed connection) would keep reading the
                # blocks after on_done: settle cancels them by aborting the connection first.
                ok = await posted.settle(self._send_timeout_s if error is None else 0.0, lambda: self._server.forget(ep))
                error = error or posted.first_error()
            if not ok:
                logger.info("KV send of %r failed or timed out: %r", transfer_id, error)
        except asyncio.CancelledError:  # closing: settle has already made sure nothing is posted
            pass
        finally:
            if corrupted is not None:  # UCX no longer reads the blocks: restore the flipped byte
                self._mem.flip_byte(corrupted)
            served = ok and reg is not None
            obs.finish(served, nbytes, None if served else refusal or "send failed")
            if reg is not None:
                if ok:
                    self.stats.bytes_sent += nbytes
                    self.stats.transfers_ok += 1
                else:
                    self.stats.transfers_failed += 1
                call_on_done(reg, ok)
