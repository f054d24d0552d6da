""":func:`splitserve.services.router.background.cancel_and_wait`, which ends the registry's and the planner's loops."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.services.router.background import cancel_and_wait


async def test_a_running_loop_is_cancelled_and_has_ended_on_return():
    ended = []

    async def loop():
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append(True)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled() and ended == [True]
    await cancel_and_wait(task)  # already ended: nothing happens
    await cancel_and_wait(None)


async def test_a_task_that_failed_raises_its_error():
    async def boom():
        raise RuntimeError("loop died")

    task = asyncio.create_task(boom())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="loop died"):
        await cancel_and_wait(task)
