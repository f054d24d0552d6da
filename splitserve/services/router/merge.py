"""Interleave several async iterators into one, in arrival order (the continued choices of one request)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream as they arrive; ends when all streams ended.

    The first exception of any stream is raised here after the other streams are closed. Closing this generator
    (or cancelling its consumer) closes every stream (``aclose``) before it returns, so no stream outlives it.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    await queue.put((item, None))
            await queue.put((_DONE, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((_DONE, exc))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _DONE:
                running -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
