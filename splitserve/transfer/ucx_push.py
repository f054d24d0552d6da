"""KV push over UCX (:mod:`splitserve.transfer.push` has the lifecycle, :mod:`.push_wire` the messages).

Decode side (:func:`receive_push`): like a FETCH, every receive is posted before the SUBSCRIBE goes out -- the
PUSH STATUS on ``tag_base`` and each (layer group, block) straight into its slice of the destination blocks -- and
all are awaited at once; the sender completes every data receive (empty when it fails), so nothing stays
posted on success or on a failure message. A timeout, a cancel or a broken connection settles like a fetch (grace,
then abort the endpoint). Prefill side (:class:`UcxSubscriber`): sends straight from the KV pool. Either side's
pool may be in host or CUDA memory; the buffers come from its :class:`~splitserve.transfer.kv_memory.KVMemory` (on
the ``staged`` path: host copies, landed in the pool once the push completed and was verified).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from splitserve.errors import InvalidRequest, KVChecksumMismatch, KVLayoutMismatch, KVTransferCancelled, KVTransferError
from splitserve.telemetry.propagation import current_trace_context
from splitserve.transfer import push_wire, wire
from splitserve.transfer.common import Status
from splitserve.transfer.kv_memory import KVMemory, checksum as parts_checksum
from splitserve.transfer.push import PushResult, Subscriber, group_bounds
from splitserve.transfer.ucx_requests import Posted, SettleOnError

logger = logging.getLogger("splitserve.transfer.ucx")
_EMPTY = np.empty(0, dtype=np.uint8)


class UcxSubscriber(Subscriber):
    """A decode worker's subscription on one connection of the KV sender.

    Args:
        ep: the connection. forget: aborts it (cancels what is posted). pool: the sender's KV pool (its path's buffers).
        block_nbytes / num_layers: of the layout. req: the SUBSCRIBE.
    """

    def __init__(self, ep, forget, pool: KVMemory, block_nbytes: int, num_layers: int,
                 req: push_wire.SubscribeRequest) -> None:
        self._ep, self._forget, self._pool = ep, forget, pool
        self._bn, self._ln = block_nbytes, block_nbytes // num_layers
        self._tag = req.tag_base
        self._checksum = bool(req.flags & wire.FLAG_CHECKSUM)
        self.num_blocks = req.num_blocks
        self.groups = group_bounds(num_layers, req.layer_groups)
        self.trace_context = req.trace_context
        self._sent = 0
        self._done = False
        self._posted: Posted | None = None
        self._error: BaseException | None = None
        try:
            self._posted = Posted(ep)
        except Exception as exc:  # the endpoint failed before anything was posted
            self._error = exc

    def _p(self) -> Posted:
        if self._posted is None:
            raise KVTransferError(f"push connection failed: {self._error!r}")
        return self._posted

    def alive(self) -> bool:
        uep = getattr(self._ep, "_ep", None)
        if self._posted is None or uep is None:
            return False
        try:
            uep.raise_on_error()
        except Exception:
            return False
        return self._posted.first_error() is None

    def send_group(self, j: int, src_block_ids: list[int]) -> int:
        p, (l0, l1) = self._p(), self.groups[j]
        bn, ln, base = self._bn, self._ln, self._tag + 1 + j * self.num_blocks
        for i, s in enumerate(src_block_ids):
            p.send(self._pool.send_range(s * bn + l0 * ln, (l1 - l0) * ln), base + i)
        self._sent = j + 1
        return len(src_block_ids) * (l1 - l0) * ln

    def _empties(self) -> None:
        p = self._p()
        for k in range(self._sent * self.num_blocks, len(self.groups) * self.num_blocks):
            p.send(_EMPTY, self._tag + 1 + k)
        self._sent = len(self.groups)

    def complete(self, first_token_ids: list[int], finished: bool, src_block_ids: list[int] | None) -> None:
        checksum = None
        if finished:
            self._empties()
        elif self._checksum:
            checksum = parts_checksum([self._pool.host_blocks(s, 1) for s in src_block_ids])
        self._p().send(push_wire.encode_push_status(Status.OK, first_token_ids, finished, checksum), self._tag)
        self._done = True

    def fail(self, detail: str, status: Status = Status.FAILED) -> None:
        if self._done:
            return
        self._done = True
        self._empties()
        self._p().send(push_wire.encode_push_status(status, detail=detail), self._tag)

    async def settle(self, timeout_s: float) -> bool:
        if self._posted is None:
            return False
        return await self._posted.settle(timeout_s, lambda: self._forget(self._ep))


async def receive_push(rx, endpoint: str, bootstrap_id: str, dst_block_ids: list[int], layer_groups: int,
                       num_layers: int, timeout_s: float) -> PushResult:
    """:meth:`UcxKVReceiver.receive_push` (``rx``: the receiver)."""
    nb = len(dst_block_ids)
    if nb == 0 or len(set(dst_block_ids)) != nb or any(not 0 <= d < rx._num_blocks for d in dst_block_ids):
        raise InvalidRequest("destination block ids empty, repeated or out of range")
    if timeout_s <= 0:
        raise InvalidRequest("timeout_s must be positive")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    ep = await rx._endpoints.get(endpoint, deadline)
    groups = group_bounds(num_layers, layer_groups)
    bn, ln = rx._block_nbytes, rx._block_nbytes // num_layers
    tag = rx._next_tag()
    status_buf = np.zeros(push_wire.PUSH_STATUS_NBYTES, dtype=np.uint8)
    request = push_wire.encode_subscribe(push_wire.SubscribeRequest(
        tag, bn, rx._digest, bootstrap_id, nb, len(groups), current_trace_context(), wire.FLAG_CHECKSUM if rx._verify else 0))
    try:
        posted = Posted(ep)
    except Exception as exc:
        rx._endpoints.drop(endpoint, ep)
        raise KVTransferError(f"KV endpoint {endpoint} is closed: {exc!r}") from exc

    def abort() -> None:
        rx._endpoints.drop(endpoint, ep)
        logger.info("KV push %s from %s abandoned with receives posted: endpoint aborted", bootstrap_id, endpoint)

    grace = lambda: max(0.0, min(rx._cancel_grace_s, deadline - loop.time()))  # noqa: E731
    async with SettleOnError(posted, grace, abort, what=f"KV push {bootstrap_id!r} from {endpoint}",
                             bad_answer=f"bad push status from KV sender {endpoint}"):
        posted.recv(status_buf, tag)
        mem = rx._mem
        parts = []  # (offset in the pool, receive buffer), in tag order
        for j, (l0, l1) in enumerate(groups):
            for i, d in enumerate(dst_block_ids):
                offset = d * bn + l0 * ln
                parts.append((offset, mem.recv_range(offset, (l1 - l0) * ln)))
                posted.recv(parts[-1][1], tag + 1 + j * nb + i)
        posted.am_send(request)
        await posted.wait(deadline)
        error = posted.first_error()
        if error is not None:
            raise KVTransferError(f"KV push {bootstrap_id!r} from {endpoint} failed: {error!r}")
        st = push_wire.decode_push_status(status_buf)
        if st.status is Status.LAYOUT_MISMATCH:
            raise KVLayoutMismatch(f"KV layout mismatch with sender {endpoint}: remote [{st.detail}]")
        if st.status is Status.CANCELLED:
            raise KVTransferCancelled(f"KV push {bootstrap_id!r} from {endpoint} cancelled: {st.detail}")
        if st.status is not Status.OK:
            raise KVTransferError(f"KV push {bootstrap_id!r} from {endpoint} failed: {st.status.name} {st.detail}")
        if not st.finished:
            for offset, buf in parts:  # staged: into the pool now; in place: already there
                mem.land(offset, buf)
        if rx._verify and not st.finished:
            got = parts_checksum([mem.host_blocks(d, 1) for d in dst_block_ids])
            if st.checksum is None or got != st.checksum:
                rx.stats.checksum_failures += 1
                raise KVChecksumMismatch(f"KV push {bootstrap_id!r} from {endpoint} is corrupted")
        return PushResult(tuple(st.first_token_ids), st.finished, 0 if st.finished else nb * bn)
