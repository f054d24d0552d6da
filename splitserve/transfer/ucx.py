"""UCX (ucxx) KV transfer backend: the decode worker pulls KV blocks from the prefill worker.

Protocol (one pull = one ``fetch``)
-----------------------------------
1. The receiver merges ``src_block_ids``/``dst_block_ids`` into *segments*: runs where both the remote and
   the local ids are consecutive, so each segment is one contiguous byte range on both sides.
2. It takes a ``tag_base`` unique in its process (tags match across the whole UCX worker, not per
   endpoint) and **posts every receive first**: the STATUS reply on ``tag_base`` and segment ``i`` on
   ``tag_base + 1 + i`` -- the latter directly into ``kv_cache[dst_start : dst_start + n]``.
3. It sends one FETCH request (UCX active message, :mod:`splitserve.transfer.wire`) with the transfer id,
   ``tag_base``, bytes per block, a layout digest and the source runs ``[(src_start, n)]``.
4. The sender checks the layout, then *claims* the registration: every requested block must be registered
   under that id (never serves other blocks). It posts the STATUS (OK / NOT_FOUND / INVALID /
   LAYOUT_MISMATCH / CLOSING) and, on OK, every segment straight from its own ``kv_cache`` slice; on any
   other status it sends an empty message on every segment tag, so the receiver's posted receives always
   complete without touching the destination blocks. When all sends completed it calls
   ``on_done(id, True)``; on failure it first aborts the endpoint (which cancels the posted sends, so UCX
   no longer reads the blocks) and then calls ``on_done(id, False)``.
5. Integrity (optional, receiver's ``verify_checksum``): the FETCH sets ``FLAG_CHECKSUM``; the sender
   computes xxh3-64 over the requested blocks (one pass over memory, before posting the sends) and puts it
   in the STATUS; once the data has landed the receiver hashes its destination blocks and compares
   (:class:`KVChecksumMismatch` on a difference). The data path itself is unchanged: still zero-copy.

Copies: **zero staging copies** in splitserve on either side -- UCX reads straight from the sender's KV
pool and writes straight into the receiver's KV pool, through numpy views of the two preallocated
tensors (no bytes objects, no pickling, no intermediate buffer; the only Python-level allocations are the
request header and a 1 KiB status buffer). What the transport itself does is UCX's choice: on one host,
with ``UCX_MM_ERROR_HANDLING=y``, ``UCX_PROTO_INFO=y`` shows "rendezvous fragmented copy-in copy-out" over
sysv shared memory for messages >= 8 KiB -- the sender's progress thread copies fragments of the pool
slice into a shared segment while the receiver's copies them out into its pool (2 memcpy by UCX,
pipelined; CMA's single copy is not selected because it lacks error handling), and "eager copy-in
copy-out" below 8 KiB. Between hosts it is TCP (kernel socket buffers) or, with an RDMA-capable UCX
build, zero-copy RDMA straight between the two pools.

Failure handling
----------------
* Unknown id: the sender answers NOT_FOUND -> :class:`TransferNotFound` after one round trip.
* Peer unreachable / dead port: connect fails within the fetch's ``timeout_s`` -> :class:`KVTransferError`.
* Peer dies mid-transfer: error handling is on for every endpoint, so posted receives fail with a
  connection reset and the cached endpoint is dropped -> :class:`KVTransferError`.
* Timeout: the endpoint to that peer is aborted (this cancels every receive posted on it, including
  those of *other* fetches from the same peer, which then fail too) -> :class:`KVTransferError`.

Cancellation (``asyncio.CancelledError``)
-----------------------------------------
ucxx cannot cancel one posted receive; cancelling the asyncio task leaves the UCX request posted, and it
would later write into blocks the caller has freed. So a cancelled fetch does not return until every
receive it posted has completed: it waits up to ``cancel_grace_s`` (bounded by the fetch's deadline) for
the sender -- which posts everything at once -- to finish; if receives are still pending after that, it
aborts the endpoint, which (``closeBlocking``) cancels the requests and returns only when UCX has
finished cancelling them. Only then is ``CancelledError`` re-raised. The cost of that fallback is that
concurrent fetches from the same peer fail with :class:`KVTransferError` and the next fetch reconnects.

Threads/loops: ucxx runs in ``progress_mode="thread"`` with Python futures, initialised inside the running
loop (:mod:`splitserve.transfer.ucx_runtime`); all methods except ``register``/``unregister`` must run on
that loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import numpy as np
import torch

from splitserve.errors import InvalidRequest, KVChecksumMismatch, KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.transfer import ucx_runtime, wire
from splitserve.transfer.base import KVReceiver, KVSender, OnDone, TransferRefused, TransferStats
from splitserve.transfer.common import (
    Registration,
    Status,
    TransferTable,
    advertise_host,
    byte_view,
    call_on_done,
    check_cache,
    compute_segments,
    format_endpoint,
    layout_digest,
    parse_endpoint,
    segments_checksum,
)
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.ucx_connect import create_endpoint
from splitserve.telemetry.propagation import current_trace_context
from splitserve.telemetry.transfer import start_send

logger = logging.getLogger("splitserve.transfer.ucx")

__all__ = ["UcxKVReceiver", "UcxKVSender"]

_EMPTY = np.empty(0, dtype=np.uint8)

# Tags: 0xA5 in the top byte, a 32-bit per-process fetch counter, 24 bits for the message within a fetch.
_TAG_PREFIX = 0xA5 << 56
_tag_counter = itertools.count(1)


def _next_tag_base() -> int:
    return _TAG_PREFIX | ((next(_tag_counter) & 0xFFFFFFFF) << 24)


def _ucxx():
    import ucxx  # noqa: PLC0415 - lazy: importing ucxx touches os.environ and loads UCX

    return ucxx


def _consume(futures) -> None:
    """Retrieve results of finished futures so asyncio does not log 'exception was never retrieved'."""
    for f in futures:
        if f.done() and not f.cancelled():
            f.exception()


# Messages are posted directly on the ucxx endpoint's UCXEndpoint (``Endpoint._ep``, ucxx 0.52) instead of
# through the ``Endpoint.send``/``recv`` coroutines: a fetch posts all its receives and the request
# synchronously (no window in which some are posted and others not), and no asyncio task is created per
# message (each costs a loop hop, ~0.1 ms on a small machine). Completion is awaited on the request's
# asyncio future, which ucxx's notifier thread resolves; ``check_error`` then raises the UCX error.


class _Posted:
    """UCX requests posted on one endpoint, with the buffers they use kept alive until completion."""

    __slots__ = ("_uep", "_worker", "requests", "futures", "_buffers")

    # ucxx hands each request a future from a pool that its notifier thread refills about once per
    # completion batch; many transfers posting at once (150 concurrent requests) emptied it, and ucxx's
    # emergency refill from inside getFuture() then failed and aborted the process. So the pool is topped
    # up before every post, on the loop thread (a cheap no-op while it is full enough).

    def __init__(self, ep) -> None:
        from ucxx._lib.libucxx import UCXCloseError  # noqa: PLC0415

        uep = getattr(ep, "_ep", None)
        ctx = getattr(ep, "_ctx", None)
        if uep is None or ctx is None:
            raise UCXCloseError("Endpoint closed")
        uep.raise_on_error()
        self._uep = uep
        self._worker = ctx.worker
        self.requests: list = []
        self.futures: list[asyncio.Future] = []
        self._buffers: list = []

    def _refill(self) -> None:
        self._worker.populate_python_futures_pool()

    def _add(self, req, buf) -> asyncio.Future:
        fut = req.future
        if fut is None:  # pragma: no cover - only without Python futures, which ucx_runtime never uses
            fut = asyncio.ensure_future(req.wait())
        self.requests.append(req)
        self.futures.append(fut)
        self._buffers.append(buf)
        return fut

    def recv(self, buf, tag: int) -> asyncio.Future:
        from ucxx._lib.arr import Array  # noqa: PLC0415
        from ucxx.types import Tag, TagMaskFull  # noqa: PLC0415

        arr = Array(buf)
        self._refill()
        return self._add(self._uep.tag_recv(arr, Tag(tag), TagMaskFull), (buf, arr))

    def send(self, buf, tag: int) -> asyncio.Future:
        from ucxx._lib.arr import Array  # noqa: PLC0415
        from ucxx.types import Tag  # noqa: PLC0415

        arr = Array(buf)
        self._refill()
        return self._add(self._uep.tag_send(arr, Tag(tag)), (buf, arr))

    def am_send(self, buf) -> asyncio.Future:
        from ucxx._lib.arr import Array  # noqa: PLC0415

        arr = Array(buf)
        self._refill()
        return self._add(self._uep.am_send(arr), (buf, arr))

    def first_error(self) -> BaseException | None:
        """The first error among completed requests (UCX status checked, not just the future)."""
        for req, fut in zip(self.requests, self.futures):
            if not fut.done():
                continue
            try:
                if not fut.cancelled() and fut.exception() is not None:
                    return fut.exception()
                req.check_error()
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                return exc
        return None

    def pending(self) -> list[asyncio.Future]:
        return [f for f in self.futures if not f.done()]


def _abort_endpoint(ep) -> None:
    """Close ``ep`` now: cancels every request posted on it and returns once UCX finished cancelling."""
    try:
        ep.abort(period=2 * 10**9, max_attempts=1)
    except Exception:  # pragma: no cover - defensive
        logger.exception("aborting UCX endpoint failed")


# ========================================================================================================
# sender


class UcxKVSender(KVSender):
    """Serves pulls of registered blocks of ``kv_cache`` over a ucxx listener."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        send_timeout_s: float = 30.0,
        corrupt_sends: bool = False,
    ) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._corrupt_sends = bool(corrupt_sends)  # fault injection for tests (splitserve.transfer.faults)
        self._kv = kv_cache  # keeps the memory behind self._bytes alive
        self._bytes = byte_view(kv_cache).numpy()
        self._block_nbytes = layout.block_nbytes
        self._digest = layout_digest(layout)
        self._layout = layout
        self._host = advertise_host(host)
        self._port = int(port)
        self._send_timeout_s = float(send_timeout_s)
        self._table = TransferTable(self._num_blocks)
        self._listener = None
        self._peers: set = set()
        self._conn_tasks: set[asyncio.Task] = set()
        self._serve_tasks: dict[asyncio.Task, object] = {}  # task -> endpoint it sends on
        self._acquired = False
        self._closing = False
        self.stats = TransferStats()

    # ---------------------------------------------------------------- API
    async def start(self) -> None:
        if self._listener is not None:
            return
        if self._closing:
            raise RuntimeError("sender is closed")
        ucx_runtime.acquire()
        self._acquired = True
        try:
            self._listener = _ucxx().create_listener(self._on_connect, port=self._port)
        except Exception:
            self._acquired = False
            ucx_runtime.release()
            raise
        self._port = self._listener.port
        logger.info("KV sender listening, advertised as %s", self.endpoint)

    @property
    def endpoint(self) -> str:
        if self._listener is None and self._port == 0:
            raise RuntimeError("endpoint is known only after start()")
        return format_endpoint(self._host, self._port)

    def register(self, transfer_id: str, block_ids: list[int], on_done: OnDone) -> None:
        if self._closing:
            raise RuntimeError("sender is closed")
        self._table.register(transfer_id, block_ids, on_done)

    def unregister(self, transfer_id: str) -> bool:
        return self._table.unregister(transfer_id)

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        listener = self._listener
        if listener is not None:
            listener.close()  # stop accepting; the object is kept until its handlers have returned
        # Transfers already being sent usually complete within milliseconds: let them report success.
        if self._serve_tasks:
            await asyncio.wait(list(self._serve_tasks), timeout=1.0)
        # Aborting the endpoints cancels posted sends and AM receives; the tasks then finish by themselves.
        for ep in list(self._peers):
            _abort_endpoint(ep)
        self._peers.clear()
        tasks = [*self._conn_tasks, *self._serve_tasks]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for _ in range(3):  # ucxx retires finished listener handlers one loop iteration later
            await asyncio.sleep(0)
        self._listener = None
        del listener
        for reg in self._table.drain():
            self.stats.transfers_failed += 1
            call_on_done(reg, False)
        if self._acquired:
            self._acquired = False
            ucx_runtime.release()

    # ---------------------------------------------------------------- connection handling
    async def _on_connect(self, ep) -> None:
        if self._closing:
            _abort_endpoint(ep)
            return
        task = asyncio.current_task()
        self._conn_tasks.add(task)
        self._peers.add(ep)
        try:
            while not self._closing:
                try:
                    msg = await ep.am_recv()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # peer closed or connection error
                    logger.debug("KV sender connection ended: %s", exc)
                    break
                if not self._dispatch(ep, msg):
                    break
        except asyncio.CancelledError:
            pass
        finally:
            self._conn_tasks.discard(task)
            if not self._closing:
                # Let sends already posted on this endpoint finish (they fail fast if the peer is gone).
                mine = [t for t, e in self._serve_tasks.items() if e is ep]
                if mine:
                    await asyncio.wait(mine, timeout=self._send_timeout_s)
                self._peers.discard(ep)
                _abort_endpoint(ep)

    def _dispatch(self, ep, msg) -> bool:
        """Handle one FETCH request; False means the peer is broken and the connection is dropped."""
        try:
            req = wire.decode_fetch(msg)
        except wire.WireError as exc:
            logger.warning("KV sender: malformed request, dropping connection: %s", exc)
            return False
        reg: Registration | None = None
        obs = start_send("ucx", req.transfer_id, sum(n for _s, n in req.runs), req.trace_context)
        if self._closing:
            status, detail = Status.CLOSING, "sender is closing"
        elif req.block_nbytes != self._block_nbytes or req.layout_digest != self._digest:
            status, detail = Status.LAYOUT_MISMATCH, self._layout.describe()
        else:
            # Serves only blocks registered under this id (registered ids are range-checked).
            status, reg, detail = self._table.claim(req.transfer_id, req.runs)
        # Post the STATUS and every segment now (no loop hop before the bytes start moving).
        bn = self._block_nbytes
        nbytes = 0
        checksum = None
        if req.flags & wire.FLAG_CHECKSUM and status is Status.OK:
            checksum = segments_checksum(self._bytes, req.runs, bn)
        corrupted = self._corrupt(req.runs) if status is Status.OK and self._corrupt_sends else None
        posted: _Posted | None = None
        error: BaseException | None = None
        try:
            posted = _Posted(ep)
            posted.send(wire.encode_status(status, detail, checksum), req.tag_base)
            for i, (start, count) in enumerate(req.runs):
                if status is Status.OK:
                    posted.send(self._bytes[start * bn : (start + count) * bn], req.tag_base + 1 + i)
                    nbytes += count * bn
                else:  # completes the receiver's posted receive without writing into its blocks
                    posted.send(_EMPTY, req.tag_base + 1 + i)
        except Exception as exc:  # endpoint closed or failed while posting
            error = exc
        refusal = None if status is Status.OK else f"{status.name}: {detail}"
        task = asyncio.get_running_loop().create_task(
            self._finish(ep, req.transfer_id, posted, error, reg, nbytes, obs, refusal, corrupted)
        )
        self._serve_tasks[task] = ep
        task.add_done_callback(self._serve_tasks.pop)
        return error is None

    def _corrupt(self, runs) -> int:
        """Fault injection: flip the first byte of the first requested block; returns its offset."""
        offset = runs[0][0] * self._block_nbytes
        self._bytes[offset] ^= 0xFF
        return offset

    async def _finish(
        self,
        ep,
        transfer_id: str,
        posted: _Posted | None,
        error: BaseException | None,
        reg: Registration | None,
        nbytes: int,
        obs,
        refusal: str | None,
        corrupted: int | None = None,
    ) -> None:
        """Wait for the posted sends, then report the transfer exactly once (and end its span)."""
        ok = False
        futures = posted.futures if posted is not None else []
        try:
            if error is None and futures:
                done, pending = await asyncio.wait(futures, timeout=self._send_timeout_s)
                if pending:
                    logger.warning("KV send of %r timed out after %.1fs", transfer_id, self._send_timeout_s)
                else:
                    error = posted.first_error()
                    ok = error is None
            if error is not None:
                logger.info("KV send of %r failed: %r", transfer_id, error)
        except asyncio.CancelledError:
            pass
        finally:
            if not ok and (error is not None or any(not f.done() for f in futures)):
                # Sends still posted would keep reading the blocks after on_done: cancel them by aborting.
                self._peers.discard(ep)
                _abort_endpoint(ep)
                if any(not f.done() for f in futures):
                    await asyncio.wait(futures, timeout=1.0)
            _consume(futures)
            if corrupted is not None:  # UCX no longer reads the blocks: restore the flipped byte
                self._bytes[corrupted] ^= 0xFF
            served = ok and reg is not None
            obs.finish(served, nbytes, None if served else refusal or "send failed")
            if reg is not None:
                if ok:
                    self.stats.bytes_sent += nbytes
                    self.stats.transfers_ok += 1
                else:
                    self.stats.transfers_failed += 1
                call_on_done(reg, ok)


# ========================================================================================================
# receiver


class UcxKVReceiver(KVReceiver):
    """Pulls KV blocks into ``kv_cache``; one cached endpoint per peer endpoint string."""

    def __init__(
        self, kv_cache: torch.Tensor, layout: KVLayout, *, cancel_grace_s: float = 1.0, verify_checksum: bool = False
    ) -> None:
        self._num_blocks = check_cache(kv_cache, layout)
        self._verify = bool(verify_checksum)
        self._kv = kv_cache
        self._bytes = byte_view(kv_cache).numpy()
        self._block_nbytes = layout.block_nbytes
        self._digest = layout_digest(layout)
        self._cancel_grace_s = float(cancel_grace_s)
        self._peers: dict[str, object] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._acquired = False
        self._closed = False
        self.stats = TransferStats()

    async def start(self) -> None:
        if self._acquired:
            return
        if self._closed:
            raise RuntimeError("receiver is closed")
        ucx_runtime.acquire()
        self._acquired = True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in list(self._connecting.values()):
            t.cancel()
        for ep in list(self._peers.values()):
            _abort_endpoint(ep)  # in-flight fetches see their receives cancelled
        self._peers.clear()
        if self._connecting:
            await asyncio.wait(list(self._connecting.values()), timeout=1.0)
        if self._acquired:
            self._acquired = False
            ucx_runtime.release()

    # ---------------------------------------------------------------- endpoints
    def _drop_endpoint(self, key: str, ep, *, abort: bool) -> None:
        if self._peers.get(key) is ep:
            del self._peers[key]
        if abort:
            _abort_endpoint(ep)

    async def _connect(self, key: str, host: str, port: int, connect_timeout: float):
        ep = await create_endpoint(host, port, connect_timeout)
        if self._closed:
            _abort_endpoint(ep)
            raise KVTransferError("receiver closed")
        self._peers[key] = ep
        return ep

    async def _get_endpoint(self, key: str, deadline: float):
        ep = self._peers.get(key)
        if ep is not None:
            if not ep.closed:
                return ep
            self._drop_endpoint(key, ep, abort=True)
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        task = self._connecting.get(key)
        if task is None:
            host, port = parse_endpoint(key)
            task = loop.create_task(self._connect(key, host, port, max(remaining, 0.1)))
            self._connecting[key] = task

            def _done(t: asyncio.Task, key=key) -> None:
                if self._connecting.get(key) is t:
                    del self._connecting[key]
                if not t.cancelled():
                    t.exception()

            task.add_done_callback(_done)
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(remaining, 0.0))
        except (asyncio.TimeoutError, TimeoutError):
            raise KVTransferError(f"timed out connecting to KV sender {key}") from None
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(f"cannot connect to KV sender {key}: {exc!r}") from exc

    # ---------------------------------------------------------------- fetch
    async def fetch(
        self,
        endpoint: str,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        timeout_s: float,
    ) -> int:
        if self._closed:
            raise KVTransferError("receiver is closed")
        if not self._acquired:
            raise RuntimeError("receiver not started")
        segments = compute_segments(src_block_ids, dst_block_ids, self._num_blocks)
        if not segments:
            return 0
        if len(segments) > wire.MAX_SEGMENTS:
            raise InvalidRequest("too many segments in one fetch")
        if timeout_s <= 0:
            raise InvalidRequest("timeout_s must be positive")
        parse_endpoint(endpoint)  # validate before connecting
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            ep = await self._get_endpoint(endpoint, deadline)
        except BaseException:
            self.stats.transfers_failed += 1
            raise
        try:
            nbytes = await self._fetch_on(ep, endpoint, transfer_id, segments, deadline)
        except BaseException:
            self.stats.transfers_failed += 1
            raise
        self.stats.bytes_received += nbytes
        self.stats.transfers_ok += 1
        return nbytes

    async def _fetch_on(self, ep, key: str, transfer_id: str, segments, deadline: float) -> int:
        loop = asyncio.get_running_loop()
        bn = self._block_nbytes
        tag = _next_tag_base()
        status_buf = np.zeros(wire.STATUS_BUF_NBYTES, dtype=np.uint8)
        flags = wire.FLAG_CHECKSUM if self._verify else 0
        request = wire.encode_fetch(
            wire.FetchRequest(
                tag, bn, self._digest, transfer_id, [(s, n) for s, _d, n in segments], current_trace_context(), flags
            )
        )
        try:
            posted = _Posted(ep)
        except Exception as exc:
            self._drop_endpoint(key, ep, abort=True)
            raise KVTransferError(f"KV endpoint {key} is closed: {exc!r}") from exc
        try:
            # Every receive is posted before the request goes out, with no await in between: UCX writes the
            # segments straight into the pool (zero copy), and there is no half-posted state to undo.
            posted.recv(status_buf, tag)
            for i, (_s, d, n) in enumerate(segments):
                posted.recv(self._bytes[d * bn : (d + n) * bn], tag + 1 + i)
            posted.am_send(request)
            # One wait for everything (each separate wake-up costs a loop hop): the STATUS and, on OK, the
            # data; otherwise the empty messages that complete the posted receives.
            await self._wait(posted.futures, deadline)
            error = posted.first_error()
            if error is not None:  # the connection broke (what is still pending is settled below)
                raise KVTransferError(f"KV fetch of {transfer_id!r} from {key} failed: {error!r}")
            status, detail, checksum = wire.decode_status_checksum(status_buf)  # all done: _wait raises at the deadline
            if status is Status.NOT_FOUND:
                raise TransferNotFound(detail or f"transfer {transfer_id!r} not found at {key}")
            if status is Status.INVALID:
                raise TransferRefused(f"KV sender {key} refused transfer {transfer_id!r}: {detail}")
            if status is Status.LAYOUT_MISMATCH:
                raise KVLayoutMismatch(f"KV layout mismatch with sender {key}: remote [{detail}]")
            if status is not Status.OK:
                raise KVTransferError(f"KV sender {key} refused transfer {transfer_id!r}: {status.name} {detail}")
            if self._verify:
                self._check(key, transfer_id, segments, checksum)
            return sum(n for _s, _d, n in segments) * bn
        except asyncio.CancelledError:
            remaining = deadline - loop.time()
            await self._settle(key, ep, posted, grace=max(0.0, min(self._cancel_grace_s, remaining)))
            raise
        except asyncio.TimeoutError:
            await self._settle(key, ep, posted, grace=0.0)
            raise KVTransferError(f"KV fetch of {transfer_id!r} from {key} timed out") from None
        except wire.WireError as exc:
            await self._settle(key, ep, posted, grace=0.0)
            raise KVTransferError(f"bad answer from KV sender {key}: {exc}") from None
        except (KVTransferError, TransferNotFound, KVLayoutMismatch):
            await self._settle(key, ep, posted, grace=max(0.0, min(self._cancel_grace_s, deadline - loop.time())))
            raise
        except Exception as exc:  # posting failed (endpoint closed under us) or an unexpected UCX error
            await self._settle(key, ep, posted, grace=max(0.0, min(self._cancel_grace_s, deadline - loop.time())))
            raise KVTransferError(f"KV fetch of {transfer_id!r} from {key} failed: {exc!r}") from exc
        finally:
            _consume(posted.futures)

    def _check(self, key: str, transfer_id: str, segments, expected: int | None) -> None:
        if expected is None:
            raise KVTransferError(f"KV sender {key} sent no checksum for transfer {transfer_id!r}")
        got = segments_checksum(self._bytes, [(d, n) for _s, d, n in segments], self._block_nbytes)
        if got != expected:
            self.stats.checksum_failures += 1
            raise KVChecksumMismatch(
                f"KV transfer {transfer_id!r} from {key} is corrupted: checksum {got:016x}, sender's {expected:016x}"
            )

    @staticmethod
    async def _wait(futures, deadline: float) -> None:
        """Wait for all ``futures`` until ``deadline``; raise asyncio.TimeoutError if some are still pending.
        Returns early once any failed (the others are then settled by the caller)."""
        pending = [f for f in futures if not f.done()]
        loop = asyncio.get_running_loop()
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            done, pending_set = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
            if any(not f.cancelled() and f.exception() is not None for f in done):
                # one failed: the connection is likely broken; give the rest a moment to fail too
                if pending_set:
                    await asyncio.wait(pending_set, timeout=min(0.5, max(0.0, deadline - loop.time())))
                return
            pending = list(pending_set)

    async def _settle(self, key: str, ep, posted: _Posted, *, grace: float) -> None:
        """Make sure none of the receives in ``posted`` is still posted: wait up to ``grace``, then abort the
        endpoint (cancels them; returns after UCX completed the cancellation). Defers repeated cancellation."""
        cancelled = False
        pending = posted.pending()
        if pending and grace > 0:
            try:
                await asyncio.wait(pending, timeout=grace)
            except asyncio.CancelledError:
                cancelled = True
            pending = posted.pending()
        if pending or ep.closed:
            self._drop_endpoint(key, ep, abort=bool(pending))
        if pending:
            logger.info("KV fetch from %s abandoned with %d requests posted: endpoint aborted", key, len(pending))
            try:
                await asyncio.wait(pending, timeout=1.0)
            except asyncio.CancelledError:
                cancelled = True
            left = posted.pending()
            if left:  # UCX already cancelled the requests (closeBlocking); only the futures lag behind
                logger.warning("%d cancelled KV requests did not report completion", len(left))
        if cancelled:
            raise asyncio.CancelledError()
