"""The decode side of the UCX KV transfer: pulls registered blocks of a prefill worker's KV pool into its own.

Protocol, failure handling and cancellation: :mod:`splitserve.transfer.ucx`. One cached endpoint per
peer (:class:`~splitserve.transfer.ucx_endpoints.EndpointCache`); each fetch posts every receive straight
into the destination blocks, then its FETCH request, and awaits them all at once. The destination pool may be in
host or CUDA memory (:mod:`splitserve.transfer.kv_memory`); on the ``staged`` path the segments land in host
buffers and are copied into the blocks once the sender's OK (and checksum) arrived.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import numpy as np
import torch

from splitserve.errors import InvalidRequest, KVChecksumMismatch, KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.telemetry.propagation import current_trace_context
from splitserve.transfer import ucx_runtime, wire
from splitserve.transfer.base import KVReceiver, TransferRefused, TransferStats
from splitserve.transfer.common import (
    Status,
    compute_segments,
    layout_digest,
    parse_endpoint,
)
from splitserve.transfer.kv_cache import check_cache
from splitserve.transfer.kv_memory import KVMemory, checksum as parts_checksum
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import PartialBlock, plan_rows, segment_rows
from splitserve.transfer.paths import check_staging, choose_path, staging_from_env
from splitserve.transfer.push import PushResult
from splitserve.transfer.ucx_endpoints import EndpointCache
from splitserve.transfer.ucx_push import receive_push
from splitserve.transfer.ucx_requests import Posted, SettleOnError

logger = logging.getLogger("splitserve.transfer.ucx")

# Tags: 0xA5 in the top byte, a 32-bit per-process fetch counter, 24 bits for the message within a fetch.
_TAG_PREFIX = 0xA5 << 56
_tag_counter = itertools.count(1)


def _next_tag_base() -> int:
    return _TAG_PREFIX | ((next(_tag_counter) & 0xFFFFFFFF) << 24)


class UcxKVReceiver(KVReceiver):
    """Pulls KV blocks into ``kv_cache`` (host or CUDA memory); one cached endpoint per peer endpoint string.

    ``staging``: "auto" | "always" | "never" (None: ``PD_KV_TRANSFER_STAGING``); the path is decided at
    :meth:`start` (then :attr:`path`). Raises ValueError like :class:`~splitserve.transfer.ucx_sender.UcxKVSender`."""

    def __init__(
        self, kv_cache: torch.Tensor, layout: KVLayout, *, cancel_grace_s: float = 1.0, verify_checksum: bool = False,
        staging: str | None = None,
    ) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._verify = bool(verify_checksum)
        self._kv = kv_cache
        self._staging = staging_from_env() if staging is None else check_staging(staging)
        self._mem: KVMemory | None = None  # at start(), on the chosen path
        self._block_nbytes = layout.block_nbytes
        self._digest = layout_digest(layout)
        self._num_layers = layout.num_layers
        self._partial = PartialBlock(layout)
        self._cancel_grace_s = float(cancel_grace_s)
        self._endpoints = EndpointCache("KV sender", KVTransferError)
        self.stats = TransferStats()

    async def start(self) -> None:
        if self._endpoints.closed:
            raise RuntimeError("receiver is closed")
        await self._endpoints.start()
        if self._mem is None:
            try:
                self._mem = KVMemory(self._kv, self._partial, choose_path(self._kv.device.type, ucx_runtime.transports(),
                                                                          self._staging))
            except ValueError:
                await self._endpoints.close()
                raise
            logger.info("KV receiver started (KV path %s, cache on %s)", self._mem.path, self._kv.device)

    @property
    def path(self) -> str:
        """"host", "cuda" or "staged" (:mod:`splitserve.transfer.paths`); known after :meth:`start`."""
        if self._mem is None:
            raise RuntimeError("the KV path is known only after start()")
        return self._mem.path

    async def close(self) -> None:
        await self._endpoints.close()  # in-flight fetches see their receives cancelled

    _next_tag = staticmethod(_next_tag_base)

    async def receive_push(self, endpoint: str, bootstrap_id: str, dst_block_ids: list[int], layer_groups: int,
                           timeout_s: float) -> PushResult:
        if self._endpoints.closed:
            raise KVTransferError("receiver is closed")
        if not self._endpoints.started:
            raise RuntimeError("receiver not started")
        parse_endpoint(endpoint)
        try:
            result = await receive_push(self, endpoint, bootstrap_id, dst_block_ids, layer_groups, self._num_layers, timeout_s)
        except BaseException:
            self.stats.transfers_failed += 1
            raise
        self.stats.bytes_received += result.nbytes
        self.stats.transfers_ok += 1
        return result

    # ---------------------------------------------------------------- fetch
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
        if self._endpoints.closed:
            raise KVTransferError("receiver is closed")
        if not self._endpoints.started:
            raise RuntimeError("receiver not started")
        segments = compute_segments(src_block_ids, dst_block_ids, self._num_blocks)
        if not segments:
            return 0
        segments, tail, head = plan_rows(self._partial, segments, last_block_tokens, first_block_held)
        if len(segments) > wire.MAX_SEGMENTS:
            raise InvalidRequest("too many segments in one fetch")
        if timeout_s <= 0:
            raise InvalidRequest("timeout_s must be positive")
        parse_endpoint(endpoint)  # validate before connecting
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            ep = await self._endpoints.get(endpoint, deadline)
            nbytes = await self._fetch_on(ep, endpoint, transfer_id, segments, deadline, tail, head)
        except BaseException:
            self.stats.transfers_failed += 1
            raise
        self.stats.bytes_received += nbytes
        self.stats.transfers_ok += 1
        return nbytes

    async def _fetch_on(self, ep, key: str, transfer_id: str, segments, deadline: float, tail: int, head: int) -> int:
        """One FETCH on ``ep``; ``tail`` > 0: the last segment is one block of which rows [0, tail) move; ``head`` > 0:
        the first segment is one block of which rows [head, ...) move. Packed rows are received into staging
        buffers and unpacked into their blocks once the sender's OK (and checksum) arrived."""
        loop = asyncio.get_running_loop()
        bn, bs = self._block_nbytes, self._partial.block_size
        tag = _next_tag_base()
        status_buf = np.zeros(wire.STATUS_BUF_NBYTES, dtype=np.uint8)
        rows = [segment_rows(i, len(segments), head, tail, bs) for i in range(len(segments))]
        mem = self._mem
        parts = [mem.recv_blocks(d, n) if r is None else np.empty(self._partial.nbytes(r[1] - r[0]), np.uint8)
                 for (_s, d, n), r in zip(segments, rows)]  # where each segment lands, in tag order
        flags = wire.FLAG_CHECKSUM if self._verify else 0
        request = wire.encode_fetch(
            wire.FetchRequest(
                tag, bn, self._digest, transfer_id, [(s, n) for s, _d, n in segments], current_trace_context(), flags,
                tail, head,
            )
        )
        try:
            posted = Posted(ep)
        except Exception as exc:
            self._endpoints.drop(key, ep)
            raise KVTransferError(f"KV endpoint {key} is closed: {exc!r}") from exc

        def grace() -> float:
            return max(0.0, min(self._cancel_grace_s, deadline - loop.time()))

        def abort() -> None:
            self._endpoints.drop(key, ep)
            logger.info("KV fetch from %s abandoned with requests posted: endpoint aborted", key)

        async with SettleOnError(posted, grace, abort, what=f"KV fetch of {transfer_id!r} from {key}",
                                 bad_answer=f"bad answer from KV sender {key}"):
            # Every receive is posted before the request goes out, with no await in between: UCX writes the
            # segments straight into the pool (zero copy), and there is no half-posted state to undo.
            posted.recv(status_buf, tag)
            for i, part in enumerate(parts):
                posted.recv(part, tag + 1 + i)
            posted.am_send(request)
            # One wait for everything (each separate wake-up costs a loop hop): the STATUS and, on OK, the
            # data; otherwise the empty messages that complete the posted receives.
            await posted.wait(deadline)
            error = posted.first_error()
            if error is not None:  # the connection broke (what is still pending is settled below)
                raise KVTransferError(f"KV fetch of {transfer_id!r} from {key} failed: {error!r}")
            status, detail, checksum = wire.decode_status_checksum(status_buf)  # all done: wait raises at the deadline
            if status is Status.NOT_FOUND:
                raise TransferNotFound(detail or f"transfer {transfer_id!r} not found at {key}")
            if status is Status.INVALID:
                raise TransferRefused(f"KV sender {key} refused transfer {transfer_id!r}: {detail}")
            if status is Status.LAYOUT_MISMATCH:
                raise KVLayoutMismatch(f"KV layout mismatch with sender {key}: remote [{detail}]")
            if status is not Status.OK:
                raise KVTransferError(f"KV sender {key} refused transfer {transfer_id!r}: {status.name} {detail}")
            if self._verify:
                self._check(key, transfer_id, parts, checksum)
            for (_s, d, _n), r, part in zip(segments, rows, parts):
                if r is not None:
                    mem.unpack(d, r[1], part, r[0])
                else:
                    mem.land(d * bn, part)
            return sum(p.nbytes for p in parts)

    def _check(self, key: str, transfer_id: str, parts: list, expected: int | None) -> None:
        if expected is None:
            raise KVTransferError(f"KV sender {key} sent no checksum for transfer {transfer_id!r}")
        got = parts_checksum(parts)
        if got != expected:
            self.stats.checksum_failures += 1
            raise KVChecksumMismatch(
                f"KV transfer {transfer_id!r} from {key} is corrupted: checksum {got:016x}, sender's {expected:016x}"
            )
