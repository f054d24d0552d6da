"""HTTP side of a graceful shutdown (:mod:`splitserve.rpc.shutdown`): an ASGI middleware that counts requests
in flight in the process's :class:`~splitserve.rpc.shutdown.Drain` and, once it drains, answers new ones
(``/health`` included, so load balancers stop sending) with 503 ``server_error`` / ``shutting_down`` and
``Retry-After``. Requests already running, SSE streams included, are untouched; ``/metrics`` and
``/v1/workers`` keep working."""

from __future__ import annotations

from typing import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.frontend.errors import APIError, error_response
from splitserve.frontend.sse import SHUTDOWN_EXTENSION
from splitserve.rpc.shutdown import Drain

EXEMPT = ("/metrics", "/v1/workers")


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain, exempt: Collection[str] = EXEMPT) -> None:
        self.app = app
        self.drain = drain
        self.exempt = frozenset(exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        if not self.drain.enter():
            response = error_response(APIError("the server is shutting down; retry on another replica", status=503,
                                               type="server_error", code="shutting_down"))
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        # the grace period's end, for SSE streams still open then (splitserve.frontend.sse.SSEResponse)
        scope = {**scope, "extensions": {**(scope.get("extensions") or {}), SHUTDOWN_EXTENSION: self.drain.expired}}
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.exit()
