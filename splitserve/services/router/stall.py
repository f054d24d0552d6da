"""Stall guard of a server-streaming call: a stream that sends nothing for ``timeout_s`` is cancelled and ends
with :class:`~splitserve.errors.StreamStalled` (UNAVAILABLE).

gRPC keepalive already fails the calls of a peer that is stopped, frozen or cut off (its PINGs go
unanswered). The guard covers a peer whose process answers PINGs (gRPC core threads) but whose stream makes
no progress, e.g. a wedged event loop or engine. A decode stream can legitimately be quiet for a while (KV
pull, waiting for free KV blocks, a long local prefill), so the timeout is generous and configurable
(``--decode-stall-timeout-s``). Time the consumer spends between messages (a slow client) does not count.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

import grpc

from splitserve.errors import StreamStalled

T = TypeVar("T")


async def stall_guard(call: grpc.aio.UnaryStreamCall, timeout_s: float | None, peer: str) -> AsyncIterator[T]:
    """The messages of ``call``; raises StreamStalled (naming ``peer``) after ``timeout_s`` seconds without one
    (None: no limit). Errors of the call itself propagate unchanged."""
    if timeout_s is None:
        async for msg in call:
            yield msg
        return
    loop = asyncio.get_running_loop()
    stalled = False

    def fire() -> None:
        nonlocal stalled
        stalled = True
        call.cancel()

    handle = loop.call_later(timeout_s, fire)
    try:
        async for msg in call:
            handle.cancel()
            yield msg  # suspended here: no timer armed (a consumer that leaves leaves nothing behind)
            handle = loop.call_later(timeout_s, fire)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if stalled and not (task is not None and task.cancelling()):  # our cancel, not the caller's
            raise StreamStalled(f"{peer}: no message for {timeout_s:g} s (stream stalled)") from None
        raise
    finally:
        handle.cancel()
