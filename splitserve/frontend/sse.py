"""Server-sent events and client-disconnect handling.

:class:`SSEResponse` streams ``data: ...\\n\\n`` events and, unlike Starlette's
``StreamingResponse`` on ASGI spec >= 2.4, always watches for ``http.disconnect`` and
always closes its event generator, so a client that goes away aborts generation at once.
:func:`cancel_on_disconnect` does the same for work done before a response is sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
#: ASGI scope extension: an asyncio.Event set when a graceful shutdown's grace period ran out
SHUTDOWN_EXTENSION = "splitserve.shutdown"
SHUTDOWN_ERROR = {"error": {"message": "the server shut down before this stream finished (grace period over); retry",
                            "type": "server_error", "param": None, "code": "shutting_down"}}


def sse_event(payload: Any) -> str:
    """One SSE event carrying ``payload`` (a dict, or an already-encoded JSON string)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must be consumed already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run ``work()`` unless the client disconnects first.

    Returns ``(True, result)`` when the work finished, ``(False, None)`` when the client
    went away (the work was cancelled, which closes any generator it was driving).
    Exceptions of ``work`` propagate.
    """
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        return False, None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watcher, return_exceptions=True)


class SSEResponse:
    """ASGI response that sends each string of ``events`` as body bytes (``text/event-stream``).

    On client disconnect the stream is cancelled; in every case ``events`` is closed.
    """

    def __init__(self, events: AsyncGenerator[str, None], headers: dict[str, str] | None = None) -> None:
        self._events = events
        self._headers = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **(headers or {}),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the events to the client."""
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self._headers.items()]
        shutdown = (scope.get("extensions") or {}).get(SHUTDOWN_EXTENSION)
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    await wait_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": raw})
                    with anyio.CancelScope() as stream_scope:
                        if shutdown is not None:

                            async def cut_at_shutdown() -> None:
                                await shutdown.wait()
                                stream_scope.cancel()

                            tg.start_soon(cut_at_shutdown)
                        async for event in self._events:
                            await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
                    if stream_scope.cancelled_caught:  # the grace period ran out: say so, then end cleanly
                        with anyio.CancelScope(shield=True):
                            await self._events.aclose()
                        tail = sse_event(SHUTDOWN_ERROR) + DONE
                        await send({"type": "http.response.body", "body": tail.encode("utf-8"), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client went away while we were writing
                    pass
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
