"""UCX messages posted straight on a ucxx endpoint, awaited on their futures, and settled safely.

Messages are posted on the endpoint's ``UCXEndpoint`` (``Endpoint._ep``, ucxx 0.52) instead of through the
``Endpoint.send``/``recv`` coroutines: a transfer posts all its receives and its request synchronously
(no window in which some are posted and others not), and no asyncio task is created per message (each
costs a loop hop, ~0.1 ms on a small machine). Completion is awaited on the request's asyncio future,
which ucxx's notifier thread resolves; ``check_error`` then raises the UCX error.

Invariant every user relies on: a buffer handed to :class:`Posted` may be reused or freed only once
:meth:`Posted.settle` returned (or every future completed) -- UCX writes into posted receive buffers and
reads posted send buffers until then. ``settle`` closes the endpoint when something is still posted,
which cancels it, and waits for UCX to report that.

Used by the KV transfer (``ucx_sender``, ``ucx_receiver``, ``ucx_push``) and the KV store's data plane (data
client, storage node). :class:`SettleOnError` is the receive side's exception ladder (a fetch, a push).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from splitserve.errors import KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.transfer.wire import WireError

logger = logging.getLogger("splitserve.transfer.ucx")

#: after an abort, how long to wait for UCX to report the cancelled requests (it normally takes ~ms)
ABORT_WAIT_S = 1.0


def abort_endpoint(ep) -> None:
    """Close ``ep`` now: cancels every request posted on it; returns once UCX finished cancelling."""
    try:
        ep.abort(period=2 * 10**9, max_attempts=1)
    except Exception:  # pragma: no cover - defensive
        logger.exception("aborting UCX endpoint failed")


def consume(futures) -> None:
    """Retrieve results of finished futures so asyncio does not log 'exception was never retrieved'."""
    for f in futures:
        if f.done() and not f.cancelled():
            f.exception()


def connection_tag(ep, tag: int, *, outgoing: bool) -> int:
    """The wire tag that ucxx's ``Endpoint.send``/``recv`` (without ``force_tag``) use for ``tag``: hashed
    with the tag this connection agreed at connect time, so ``tag`` need only be unique per connection
    (UCX itself matches tags across the whole worker)."""
    from ucxx._lib_async.utils import hash64bits

    return hash64bits(ep._tags["msg_send" if outgoing else "msg_recv"], hash(tag))


class Posted:
    """UCX requests posted on one endpoint, with the buffers they use kept alive until completion.

    Raises ``UCXCloseError`` (or the endpoint's error) at construction when the endpoint is closed.
    """

    __slots__ = ("_uep", "_worker", "requests", "futures", "_buffers")

    # ucxx hands each request a future from a pool that its notifier thread refills about once per
    # completion batch; many transfers posting at once (150 concurrent requests) emptied it, and ucxx's
    # emergency refill from inside getFuture() then failed and aborted the process. So the pool is topped
    # up before every post, on the loop thread (a cheap no-op while it is full enough).

    def __init__(self, ep) -> None:
        from ucxx._lib.libucxx import UCXCloseError

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

    def _add(self, req, buf) -> asyncio.Future:
        fut = req.future
        if fut is None:  # pragma: no cover - only without Python futures, which ucx_runtime never uses
            fut = asyncio.ensure_future(req.wait())
        self.requests.append(req)
        self.futures.append(fut)
        self._buffers.append(buf)
        return fut

    def recv(self, buf, tag: int) -> asyncio.Future:
        """Post a tag receive of exactly ``buf`` (a writable buffer) on ``tag`` (matched in full)."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        arr = Array(buf)
        self._worker.populate_python_futures_pool()
        return self._add(self._uep.tag_recv(arr, Tag(tag), TagMaskFull), (buf, arr))

    def send(self, buf, tag: int) -> asyncio.Future:
        """Post a tag send of ``buf`` on ``tag``."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        arr = Array(buf)
        self._worker.populate_python_futures_pool()
        return self._add(self._uep.tag_send(arr, Tag(tag)), (buf, arr))

    def am_send(self, buf) -> asyncio.Future:
        """Post an active message (the peer receives it with ``Endpoint.am_recv``)."""
        from ucxx._lib.arr import Array

        arr = Array(buf)
        self._worker.populate_python_futures_pool()
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
            except Exception as exc:  # returned to the caller
                return exc
        return None

    def pending(self) -> list[asyncio.Future]:
        return [f for f in self.futures if not f.done()]

    async def wait(self, deadline: float, futures: list[asyncio.Future] | None = None) -> None:
        """Wait until ``deadline`` (loop time) for ``futures`` (default: all); raise ``asyncio.TimeoutError``
        if some are still pending then. Returns early once one failed, after giving the others up to
        0.5 s to fail too (the connection is likely broken; the caller settles what is left)."""
        pending = [f for f in (self.futures if futures is None else futures) if not f.done()]
        loop = asyncio.get_running_loop()
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            done, pending_set = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
            if any(not f.cancelled() and f.exception() is not None for f in done):
                if pending_set:
                    await asyncio.wait(pending_set, timeout=min(0.5, max(0.0, deadline - loop.time())))
                return
            pending = list(pending_set)

    async def settle(self, grace_s: float, abort: Callable[[], None]) -> bool:
        """Make sure nothing stays posted; True if every request completed without error.

        Waits up to ``grace_s`` for pending requests; if some are still pending or one failed, calls
        ``abort`` (which must close the endpoint: UCX then cancels what is posted) and waits up to
        :data:`ABORT_WAIT_S` for UCX to report it. A cancellation arriving meanwhile is deferred until
        then (raised at the end), so a cancelled caller never frees buffers that UCX still uses.
        """
        cancelled = False
        if self.pending() and grace_s > 0:
            try:
                await asyncio.wait(self.pending(), timeout=grace_s)
            except asyncio.CancelledError:
                cancelled = True
        ok = not self.pending() and self.first_error() is None
        if not ok:
            abort()
            if self.pending():
                try:
                    await asyncio.wait(self.pending(), timeout=ABORT_WAIT_S)
                except asyncio.CancelledError:
                    cancelled = True
            if self.pending():  # UCX already cancelled them (closeBlocking); only the futures lag behind
                logger.warning("%d cancelled UCX requests did not report completion", len(self.pending()))
        consume(self.futures)
        if cancelled:
            raise asyncio.CancelledError()
        return ok


class SettleOnError:
    """``async with``: when the block fails, settle ``posted`` (:meth:`Posted.settle`) and raise a typed error.

    * cancelled: settle with ``grace()`` seconds (a callable: evaluated at the failure), then re-raise;
    * ``asyncio.TimeoutError``: settle at once, raise ``KVTransferError("<what> timed out")``;
    * :class:`~splitserve.transfer.wire.WireError`: settle at once, raise ``KVTransferError("<bad_answer>: <exc>")``;
    * ``KVTransferError``, ``TransferNotFound``, ``KVLayoutMismatch`` (the block's own verdicts): settle with
      ``grace()``, re-raise;
    * any other ``Exception`` (posting failed, an unexpected UCX error): settle with ``grace()``, raise
      ``KVTransferError("<what> failed: <exc>")`` from it.

    ``abort`` must close the endpoint (see :meth:`Posted.settle`). A block that succeeds settles nothing: the
    caller awaited its requests.
    """

    __slots__ = ("_posted", "_grace", "_abort", "_what", "_bad_answer")

    _VERDICTS = (KVTransferError, TransferNotFound, KVLayoutMismatch)

    def __init__(self, posted: Posted, grace: Callable[[], float], abort: Callable[[], None], *, what: str,
                 bad_answer: str) -> None:
        self._posted, self._grace, self._abort = posted, grace, abort
        self._what, self._bad_answer = what, bad_answer

    async def __aenter__(self) -> Posted:
        return self._posted

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        settle = self._posted.settle
        if isinstance(exc, asyncio.CancelledError):
            await settle(self._grace(), self._abort)
            return False
        if isinstance(exc, asyncio.TimeoutError):
            await settle(0.0, self._abort)
            raise KVTransferError(f"{self._what} timed out") from None
        if isinstance(exc, WireError):
            await settle(0.0, self._abort)
            raise KVTransferError(f"{self._bad_answer}: {exc}") from None
        if isinstance(exc, self._VERDICTS):
            await settle(self._grace(), self._abort)
            return False
        if isinstance(exc, Exception):
            await settle(self._grace(), self._abort)
            raise KVTransferError(f"{self._what} failed: {exc!r}") from exc
        return False
