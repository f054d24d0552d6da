"""Server-side UCX: a listener whose connections each receive active messages and hand them to a handler.

One task per connection loops on ``am_recv``, decodes each message with ``decode`` (a ``ValueError`` --
e.g. a ``WireError`` -- drops the connection) and calls ``handle(ep, request)``; the handler answers at
once or starts work with :meth:`UcxServer.spawn` (tracked per connection). When a connection ends its spawned work
may finish (bounded by ``drain_s``; it fails fast when the peer is gone), then the endpoint is aborted so
nothing stays posted. Used by the KV sender (prefill workers) and the KV store's storage nodes.

The listener is built on ucxx's ``UCXListener`` directly rather than ``ucxx.create_listener``: ucxx's
connection handler leaves its handshake receive posted into a freed buffer when a connecting client
hangs mid-handshake (see :mod:`splitserve.transfer.ucx_connect`); connections are accepted here with
:func:`~splitserve.transfer.ucx_connect.accept_endpoint`, which settles the handshake safely.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Callable

from splitserve.transfer import ucx_runtime
from splitserve.transfer.ucx_connect import accept_endpoint
from splitserve.transfer.ucx_requests import abort_endpoint

logger = logging.getLogger("splitserve.transfer.ucx")

#: handle(ep, request) -> False to drop the connection
Handler = Callable[[object, object], bool]


class UcxServer:
    """Accepts UCX connections on ``port`` (0: any) and dispatches their active messages, decoded by
    ``decode``, to ``handle``. Start, use and close it on one event loop."""

    def __init__(self, handle: Handler, decode: Callable[[object], object] = bytes, *, port: int = 0,
                 name: str = "UCX server", drain_s: float = 30.0, handshake_timeout_s: float = 5.0) -> None:
        self._handle = handle
        self._decode = decode
        self._port = int(port)
        self.name = name
        self.drain_s = float(drain_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self._listener = None
        self.peers: set = set()
        self._conn_tasks: set[asyncio.Task] = set()  # accepting (handshake) or serving a connection
        self._work: dict[asyncio.Task, object] = {}  # task -> endpoint it serves
        self._lock = threading.Lock()
        self._accepts = 0  # connection requests handed to the loop and not yet finished (any thread)
        self._acquired = False
        self.closing = False
        self.handshakes_failed = 0

    @property
    def port(self) -> int:
        return self._port

    @property
    def started(self) -> bool:
        return self._listener is not None

    async def start(self) -> None:
        """Initialise UCX (on this loop) and listen. Raises if the port cannot be bound."""
        import ucxx._lib.libucxx as ucx_api  # lazy: importing ucxx loads UCX
        from ucxx import core

        if self._listener is not None:
            return
        if self.closing:
            raise RuntimeError(f"{self.name} is closed")
        ucx_runtime.acquire()
        self._acquired = True
        try:
            ctx = core._get_ctx()  # the context ucxx.create_listener uses
            ctx.continuous_ucx_progress()
            self._listener = ucx_api.UCXListener.create(
                worker=ctx.worker, port=self._port, cb_func=_on_connection_request,
                cb_args=(asyncio.get_running_loop(), weakref.ref(self)), deliver_endpoint=True)
        except Exception:
            self._acquired = False
            ucx_runtime.release()
            raise
        self._port = self._listener.port

    def spawn(self, ep, coro) -> asyncio.Task:
        """Run ``coro`` as work of the connection ``ep`` (waited for when the connection ends)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._work[task] = ep
        task.add_done_callback(self._work.pop)
        return task

    def forget(self, ep) -> None:
        """Drop the connection ``ep`` and abort it (cancels whatever is posted on it; no-op if done)."""
        self.peers.discard(ep)
        abort_endpoint(ep)

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop accepting, let spawned work finish for up to ``drain_s``, abort every connection (cancels
        what is posted), cancel what is left and release UCX."""
        if self.closing:
            return
        self.closing = True
        self._listener = None  # stops accepting
        if self._work and drain_s > 0:
            await asyncio.wait(list(self._work), timeout=drain_s)
        for ep in list(self.peers):
            abort_endpoint(ep)
        self.peers.clear()
        tasks = [*self._conn_tasks, *self._work]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for _ in range(100):  # connection requests already handed to the loop see `closing` and give up
            with self._lock:
                if self._accepts == 0:
                    break
            await asyncio.sleep(0.01)
        if self._acquired:
            self._acquired = False
            ucx_runtime.release()

    # ---------------------------------------------------------------- connections
    def _submitted(self, delta: int) -> None:
        with self._lock:
            self._accepts += delta

    async def _accept(self, uep) -> None:
        task = asyncio.current_task()
        self._conn_tasks.add(task)
        try:
            if self.closing:
                uep.close_blocking(period=2 * 10**9, max_attempts=1)
                return
            try:
                ep = await accept_endpoint(uep, self.handshake_timeout_s)
            except Exception as exc:  # the client went away or hung mid-handshake
                self.handshakes_failed += 1
                logger.info("%s: connection handshake failed: %r", self.name, exc)
                return
            await self._serve(ep)
        except asyncio.CancelledError:
            pass
        finally:
            self._conn_tasks.discard(task)
            self._submitted(-1)

    async def _serve(self, ep) -> None:
        if self.closing:
            abort_endpoint(ep)
            return
        self.peers.add(ep)
        try:
            while not self.closing:
                try:
                    msg = await ep.am_recv()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # peer closed or connection error
                    logger.debug("%s: connection ended: %s", self.name, exc)
                    break
                try:
                    request = self._decode(msg)
                except ValueError as exc:
                    logger.warning("%s: malformed request, dropping the connection: %s", self.name, exc)
                    break
                try:
                    keep = self._handle(ep, request)
                except Exception:
                    logger.exception("%s: handling a message failed; dropping the connection", self.name)
                    keep = False
                if not keep:
                    break
        finally:
            if not self.closing:
                mine = [t for t, e in self._work.items() if e is ep]
                if mine:  # work already posted on this connection (it fails fast if the peer is gone)
                    await asyncio.wait(mine, timeout=self.drain_s)
                self.forget(ep)


def _on_connection_request(uep, loop: asyncio.AbstractEventLoop, server_ref) -> None:
    """Called by UCX on its progress thread for each connection request: accept on the server's loop."""
    server = server_ref()
    if server is None or loop.is_closed():
        return
    server._submitted(1)
    try:
        asyncio.run_coroutine_threadsafe(server._accept(uep), loop)
    except RuntimeError:  # the loop is shutting down
        server._submitted(-1)
