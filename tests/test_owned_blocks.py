"""OwnedBlocks: one owner per reference on KV blocks. Unit rules against a recording pool, then the engine's side
(allocate_blocks, prefill, decode_prefilled) with the real engine: every path ends with the pool at baseline."""

from __future__ import annotations

import asyncio
import logging

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.owned_blocks import BlocksReleased, OwnedBlocks
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest
from splitserve.model import load_model
from splitserve.paths import default_model_path

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Pool:
    """Records the commands an owner queues (what EngineCore.free / incref receive)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def free(self, block_ids: list[int]) -> None:
        self.calls.append(("free", list(block_ids)))

    def incref(self, block_ids: list[int]) -> None:
        self.calls.append(("incref", list(block_ids)))


def test_free_is_idempotent():
    pool = Pool()
    blocks = OwnedBlocks([3, 4], pool)
    assert blocks.block_ids == [3, 4] and blocks.owned and len(blocks) == 2
    blocks.free()
    blocks.free()
    assert pool.calls == [("free", [3, 4])] and not blocks.owned and not blocks.consumed


def test_a_consumed_owner_frees_nothing_and_cannot_be_used_again():
    pool = Pool()
    blocks = OwnedBlocks([1, 2], pool)
    assert blocks.take() == [1, 2] and blocks.consumed
    blocks.free()
    assert pool.calls == []
    for use in (lambda: blocks.block_ids, blocks.take, blocks.move, blocks.share, lambda: blocks.truncate(1)):
        with pytest.raises(BlocksReleased, match="already consumed"):
            use()


def test_use_after_free_raises():
    blocks = OwnedBlocks([1], Pool())
    blocks.free()
    with pytest.raises(BlocksReleased, match="already freed"):
        blocks.take()


def test_move_hands_the_same_reference_to_a_new_owner():
    pool = Pool()
    blocks = OwnedBlocks([5, 6], pool)
    lease = blocks.move()
    blocks.free()
    assert pool.calls == []
    lease.free()
    lease.free()
    assert pool.calls == [("free", [5, 6])]


def test_share_takes_one_more_reference_with_its_own_owner():
    pool = Pool()
    blocks = OwnedBlocks([1, 2, 3, 4], pool)
    write = blocks.share(1, 3)
    assert write.block_ids == [2, 3] and pool.calls == [("incref", [2, 3])]
    blocks.free()
    write.free()
    assert pool.calls == [("incref", [2, 3]), ("free", [1, 2, 3, 4]), ("free", [2, 3])]


def test_truncate_frees_the_rest():
    pool = Pool()
    blocks = OwnedBlocks([7, 8, 9], pool)
    blocks.truncate(1)
    assert blocks.block_ids == [7] and pool.calls == [("free", [8, 9])]
    with pytest.raises(ValueError):
        blocks.truncate(-1)


async def test_async_with_frees_on_exit_and_on_error_unless_consumed():
    pool = Pool()
    async with OwnedBlocks([1], pool):
        pass
    with pytest.raises(KeyError):
        async with OwnedBlocks([2], pool):
            raise KeyError("x")
    async with OwnedBlocks([3], pool) as blocks:
        lease = blocks.move()
    assert pool.calls == [("free", [1]), ("free", [2])] and lease.owned


def test_an_owner_dropped_while_owning_frees_and_warns(caplog):
    pool = Pool()
    with caplog.at_level(logging.WARNING, "splitserve.engine.owned_blocks"):
        OwnedBlocks([4, 5], pool)  # (CPython drops it at once: reference counting)
    assert pool.calls == [("free", [4, 5])] and "dropped without free()" in caplog.text
    OwnedBlocks([6], pool).take()
    assert pool.calls == [("free", [4, 5])]


# ----------------------------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def lm():
    return load_model(default_model_path())


@pytest.fixture
async def engine(lm):
    e = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await e.start()
    yield e
    stats = await e.stats()  # answered after every free queued before it
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["requests_running"] == 0, stats
    await e.stop()


async def free_count(engine) -> int:
    return (await engine.stats())["kv_blocks_free"]


async def until_stat(engine, key: str, timeout_s: float = 10.0) -> None:
    """Poll the engine's stats until ``key`` is non-zero."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not (await engine.stats())[key]:
        assert loop.time() - t0 < timeout_s, f"{key} stayed 0"
        await asyncio.sleep(0.01)


async def test_allocated_blocks_are_freed_by_async_with(engine):
    async with await engine.allocate_blocks(3) as blocks:
        assert len(set(blocks.block_ids)) == 3
        assert await free_count(engine) == engine.num_blocks - 3
    assert await free_count(engine) == engine.num_blocks


async def test_prefill_output_owns_the_prompt_kv_and_decode_prefilled_consumes_it(engine, lm):
    prompt = lm.tokenizer.encode("Once upon a time, there was a little girl")
    ref = [t async for out in engine.generate("ref", prompt, GREEDY) for t in out.token_ids]
    out = await engine.prefill("p", prompt, GREEDY)
    assert out.first_token_id == ref[0] and out.blocks.owned
    async with out.blocks as blocks:
        stream = engine.decode_prefilled("d", prompt, GREEDY, out.first_token_id, blocks)
        assert blocks.owned  # taken when the stream starts
        tokens = [out.first_token_id] + [t async for o in stream for t in o.token_ids]
        assert blocks.consumed
    assert tokens == ref
    with pytest.raises(BlocksReleased):  # handing it over again
        engine.decode_prefilled("d2", prompt, GREEDY, out.first_token_id, blocks)


async def test_a_stream_over_freed_blocks_raises(engine, lm):
    prompt = lm.tokenizer.encode("Once upon a time")
    out = await engine.prefill("p", prompt, GREEDY)
    stream = engine.decode_prefilled("d", prompt, GREEDY, out.first_token_id, out.blocks)
    out.blocks.free()
    with pytest.raises(BlocksReleased):
        await stream.__anext__()


async def test_a_refused_prefill_leaves_cached_blocks_with_the_caller(engine, lm):
    prompt = lm.tokenizer.encode("Once upon a time")
    async with await engine.allocate_blocks(1) as cached:
        with pytest.raises(InvalidRequest):
            await engine.prefill("p", prompt, GREEDY, cached=cached, num_cached_tokens=len(prompt))
        assert cached.owned
    with pytest.raises(BlocksReleased):
        await engine.prefill("p", prompt, GREEDY, cached=cached, num_cached_tokens=1)


async def test_a_prefill_with_cached_blocks_consumes_them_and_is_cancel_safe(engine, lm):
    prompt = list(range(3, 3 + 40))  # needs more blocks than the one handed in
    held = await engine.allocate_blocks(engine.num_blocks - 1)  # the prefill must wait for blocks
    cached = await engine.allocate_blocks(1)
    task = asyncio.create_task(engine.prefill("p", prompt, GREEDY, cached=cached, num_cached_tokens=0))
    await until_stat(engine, "requests_waiting")
    assert cached.consumed
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    held.free()


async def test_a_cancelled_allocation_frees_what_it_got(engine):
    held = await engine.allocate_blocks(engine.num_blocks)
    waiting = asyncio.create_task(engine.allocate_blocks(2))
    await until_stat(engine, "kv_allocations_waiting")
    held.truncate(engine.num_blocks - 2)  # the waiter may get them now, but its caller is gone
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    held.free()
