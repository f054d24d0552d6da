"""The HTTP listener of the router and the colocated server: uvicorn with read deadlines and a connection cap.

uvicorn (h11) alone holds a connection forever while a client sends half a request header, or opens a
socket and sends nothing: a few hundred such sockets exhaust a 1,024 open-file limit and every request,
``/health`` too, hangs (a slowloris). Here each connection has, in turn:

* an idle deadline: a new connection must start a request within ``keepalive_timeout_s`` (after a
  response, uvicorn's own keep-alive timeout applies, the same number);
* a header deadline: the whole request head must arrive within ``header_timeout_s`` of its first byte
  (absolute: trickling bytes does not extend it);
* a body deadline: the whole body must arrive within ``body_timeout_s`` of the end of the head.

A connection past its deadline is closed (a body cut short reaches the app as ``http.disconnect``,
which aborts the request). Beyond ``max_connections`` open connections, requests get an immediate 503
(uvicorn's ``limit_concurrency``). The response phase is the application's (request deadlines).

Settings (environment; seconds unless named otherwise): ``PD_HTTP_HEADER_TIMEOUT_S`` (10),
``PD_HTTP_BODY_TIMEOUT_S`` (30), ``PD_HTTP_KEEPALIVE_TIMEOUT_S`` (5), ``PD_HTTP_MAX_CONNECTIONS``
(default: half the soft open-file limit, at most 4,096).
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitserve.frontend.http_limits import HttpLimits


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the idle, header and body deadlines of :class:`HttpLimits`."""

    limits: HttpLimits = HttpLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._phase = "idle"  # idle -> head -> body -> app -> (response done) idle ...
        self._deadline: asyncio.TimerHandle | None = None
        self._arm(self.limits.keepalive_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._phase == "idle":  # the first byte of a request: the whole head is due within the header timeout
            self._phase = "head"
            self._arm(self.limits.header_timeout_s)
        super().data_received(data)
        state = self.conn.their_state
        if self._phase == "head" and state is h11.SEND_BODY:
            self._phase = "body"
            self._arm(self.limits.body_timeout_s)
        if self._phase in ("head", "body") and state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._phase = "app"  # the request is read; the response is the application's (request deadlines)
            self._disarm()

    def on_response_complete(self) -> None:
        self._phase = "idle"  # uvicorn arms its keep-alive timeout; the next request's first byte arms ours
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._phase in ("idle", "head", "body") and not self.transport.is_closing():
            self.transport.close()  # a body cut short: the app's receive() gets http.disconnect


def http_server(app, host: str, port: int, limits: HttpLimits | None = None, *, graceful_s: float = 1.0) -> uvicorn.Server:
    """A uvicorn server for ``app`` on ``host:port`` with the read deadlines and connection cap of ``limits``
    (default: :meth:`HttpLimits.from_env`). Signal handling stays with the caller (graceful drain).

    Raises:
        ValueError: a bad ``PD_HTTP_*`` value (named).
    """
    limits = limits or HttpLimits.from_env()
    protocol = type("DeadlineH11", (DeadlineH11Protocol,), {"limits": limits})
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", http=protocol,
                            timeout_keep_alive=int(max(1, round(limits.keepalive_timeout_s))),
                            limit_concurrency=limits.max_connections,
                            timeout_graceful_shutdown=max(1, int(graceful_s)))  # after our drain: what is left is cancelled
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # signals are the caller's (serve_until_signalled)
    return server
