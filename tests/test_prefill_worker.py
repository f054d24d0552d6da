"""PrefillWorker (services/prefill/worker.py) without gRPC: two engines, the inproc KV transfer, and an in-memory
KV store for the prefix-reuse and store-transfer paths. The KV it hands over decodes to the tokens of a colocated
``engine.generate``; held, released, failed and cancelled requests leave every KV block free."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest
from splitserve.model import load_model
from splitserve.paths import default_model_path
from splitserve.kvstore.kv_blocks import tail_key
from tests.worker_harness import GREEDY, STORY, assert_no_leak, reference, start_pair, stop_pair, until


@pytest.fixture(scope="module")
def lm():
    return load_model(default_model_path())


@pytest.fixture
def prompt(lm):
    return lm.tokenizer.encode(STORY)  # more than one KV block, ending in a partial one


@pytest.fixture
async def started(lm, caplog):
    pairs = []

    async def start(**kw):
        pairs.append(await start_pair(lm, **kw))
        return pairs[-1]

    yield start
    for p in pairs:
        await assert_no_leak(p, caplog)
        await stop_pair(p)


async def test_the_kv_is_held_under_a_lease_until_pulled(started, prompt):
    pair = await started()
    res = await pair.prefill.prefill("r1", prompt, GREEDY)
    h = res.handle
    bs = pair.p_engine.layout.block_size
    assert res.finish_reason is None and res.cached_tokens == 0 and not h.via_store and h.store_tail_key == ""
    assert h.num_tokens == len(prompt) and len(h.block_ids) == -(-len(prompt) // bs)
    assert h.endpoint == pair.prefill.sender.endpoint and h.transport == "inproc" and h.lease_ms == 30000
    assert h.layout == pair.p_engine.layout and len(pair.prefill.leases) == 1
    assert (await pair.p_engine.stats())["kv_blocks_free"] == pair.p_engine.num_blocks - len(h.block_ids)
    async with await pair.d_engine.allocate_blocks(len(h.block_ids)) as dst:
        await pair.decode.receiver.fetch(h.endpoint, h.transfer_id, list(h.block_ids), dst.block_ids, 5.0)
    assert len(pair.prefill.leases) == 0 and pair.prefill.num_requests == 1


async def test_released_kv_is_freed_once(started, prompt):
    pair = await started()
    res = await pair.prefill.prefill("r2", prompt, GREEDY)
    assert pair.prefill.release(res.handle.transfer_id)
    assert not pair.prefill.release(res.handle.transfer_id)


async def test_a_request_finished_at_prefill_holds_nothing(started, prompt, lm):
    pair = await started()
    res = await pair.prefill.prefill("r3", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert res.finish_reason == "length" and res.handle is None
    assert res.first_token_id == (await reference(pair.d_engine, prompt))[0]


@pytest.mark.parametrize("request_id, prompt_ids", [("", [1, 5]), ("x" * 257, [1, 5]), ("r", []), ("r", [1, 99999])])
async def test_bad_requests_are_invalid_and_hold_nothing(started, request_id, prompt_ids):
    pair = await started()
    with pytest.raises(InvalidRequest):
        await pair.prefill.prefill(request_id, prompt_ids, GREEDY)
    assert pair.prefill.num_requests == 0


async def test_a_caller_cancelled_while_waiting_for_blocks_leaves_the_pool_at_baseline(started, prompt):
    pair = await started()
    async with await pair.p_engine.allocate_blocks(pair.p_engine.num_blocks):  # e.g. leases not pulled yet
        task = asyncio.create_task(pair.prefill.prefill("r4", prompt, GREEDY))
        await until(lambda: _waiting(pair.p_engine), "the prefill waits for KV blocks")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert pair.prefill.in_flight == 0


async def _waiting(engine) -> bool:
    return (await engine.stats())["requests_waiting"] == 1


async def test_a_stored_prefix_is_reused_and_decodes_the_reference_tokens(started, prompt):
    pair = await started(store_mode="direct")
    ref = await reference(pair.d_engine, prompt)
    first, _, tokens = await pair.prefill_then_decode("r5", prompt)
    assert tokens == ref and first.cached_tokens == 0
    await until(lambda: pair.prefill.store.writes_in_flight == 0, "the background write finished")
    n_full = len(prompt) // pair.p_engine.layout.block_size
    assert len(pair.store.objects) == n_full  # full blocks only, in direct mode
    second, _, tokens = await pair.prefill_then_decode("r6", prompt)
    assert tokens == ref and second.cached_tokens == n_full * pair.p_engine.layout.block_size
    assert pair.prefill.store.cached_requests == 1


async def test_failed_store_reads_are_recomputed(started, prompt):
    pair = await started(store_mode="direct")
    ref = await reference(pair.d_engine, prompt)
    await pair.prefill_then_decode("r7", prompt)
    await until(lambda: pair.prefill.store.writes_in_flight == 0, "the background write finished")
    pair.store.fail_reads = True
    res, _, tokens = await pair.prefill_then_decode("r8", prompt)
    assert tokens == ref and res.cached_tokens == 0


async def test_a_request_for_prompt_logprobs_reads_no_prefix_from_the_store(started, prompt):
    pair = await started(store_mode="direct")
    ref = await reference(pair.d_engine, prompt)
    await pair.prefill_then_decode("r9", prompt)
    await until(lambda: pair.prefill.store.writes_in_flight == 0, "the background write finished")
    read = pair.store.data.bytes_read
    res, _, tokens = await pair.prefill_then_decode("r10", prompt, dataclasses.replace(GREEDY, prompt_logprobs=1))
    assert tokens == ref and res.cached_tokens == 0 and pair.store.data.bytes_read == read  # every position computed
    assert pair.prefill.store.cached_requests == 0
    res, _, tokens = await pair.prefill_then_decode("r11", prompt)  # the prefix was there to reuse
    assert tokens == ref and res.cached_tokens > 0 and pair.prefill.store.cached_requests == 1


async def test_store_transfer_mode_hands_the_kv_over_through_the_store(started, prompt):
    pair = await started(store_mode="store")
    ref = await reference(pair.d_engine, prompt)
    res, run, tokens = await pair.prefill_then_decode("r9", prompt)
    h = res.handle
    assert h.via_store and h.store_tail_key == tail_key(h.transfer_id) and len(pair.prefill.leases) == 0
    assert tokens == ref and not run.kv_recomputed and pair.decode.receiver.stats.transfers_ok == 0
    assert pair.decode.store.recomputed_tokens == 0 and pair.decode.store.loaded_tokens == len(prompt)
    await until(lambda: h.store_tail_key not in pair.store.objects, "the tail object was removed")


async def test_a_failed_put_start_falls_back_to_a_lease(started, prompt):
    pair = await started(store_mode="store")
    pair.store.fail_put_start = True
    ref = await reference(pair.d_engine, prompt)
    res, _, tokens = await pair.prefill_then_decode("r10", prompt)
    assert not res.handle.via_store and tokens == ref and pair.decode.receiver.stats.transfers_ok == 1


async def test_a_caller_cancelled_during_the_store_put_start_leaks_nothing(started, prompt):
    pair = await started(store_mode="store")
    pair.store.put_start_gate = asyncio.Event()
    task = asyncio.create_task(pair.prefill.prefill("r11", prompt, GREEDY))
    await until(lambda: pair.store.put_starts == 1, "the prefill waits at PutStart")
    assert (await pair.p_engine.stats())["kv_blocks_free"] < pair.p_engine.num_blocks  # its blocks, and the write's share
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(pair.prefill.leases) == 0


def _slow_prefill(pair, seconds: float) -> None:
    """Every forward pass of the prefill engine takes ``seconds`` longer (on the engine thread)."""
    import time

    runner = pair.p_engine.core.runner
    inner = runner.execute

    def execute(seqs):
        time.sleep(seconds)
        return inner(seqs)

    runner.execute = execute


async def test_a_prefill_that_ends_after_its_callers_deadline_leases_nothing(started, prompt):
    """The caller is gone (its deadline passed while the prefill ran): the KV is freed at once, not leased."""
    from splitserve.errors import DeadlineExceeded

    pair = await started()
    _slow_prefill(pair, 0.15)
    with pytest.raises(DeadlineExceeded, match="after its caller's deadline"):
        await pair.prefill.prefill("late", prompt, GREEDY, time_remaining=0.05)
    assert len(pair.prefill.leases) == 0


async def test_a_lease_ends_with_its_callers_deadline(started, prompt, caplog):
    """A lease outlives its caller's deadline by at most LEASE_DEADLINE_GRACE_S (was: the whole 30 s lease)."""
    import logging

    from splitserve.services.prefill.worker import LEASE_DEADLINE_GRACE_S

    pair = await started(lease_s=30.0)
    res = await pair.prefill.prefill("short", prompt, GREEDY, time_remaining=0.3)
    assert res.handle.lease_ms <= (0.3 + LEASE_DEADLINE_GRACE_S) * 1000
    assert len(pair.prefill.leases) == 1
    with caplog.at_level(logging.INFO, logger="splitserve.services.prefill.kv_leases"):
        await until(lambda: len(pair.prefill.leases) == 0, "lease ended with the caller's deadline", timeout_s=5.0)
    assert any("ended with its caller's deadline" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    res = await pair.prefill.prefill("long", prompt, GREEDY, time_remaining=120.0)
    assert res.handle.lease_ms == 30000  # the configured lease is the upper bound
    assert pair.prefill.release(res.handle.transfer_id)
