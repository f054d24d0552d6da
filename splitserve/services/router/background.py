"""The router's background loops (the registry's heartbeat, the planner) end the same way: :func:`cancel_and_wait`."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: nothing to do) and wait until it has ended; the CancelledError that ends it is not
    raised here. Any other exception the task ends with is raised."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
