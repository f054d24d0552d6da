"""DecodeWorker (services/decode/worker.py) without gRPC: two engines, the inproc KV transfer. Greedy tokens equal
a colocated ``engine.generate``; failed pulls recompute or fail as configured; cancelled callers and refused
requests leave every KV block free."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest, KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.model import load_model
from splitserve.paths import default_model_path
from splitserve.services.decode.worker import DecodeJob
from tests.worker_harness import GREEDY, STORY, assert_no_leak, reference, start_pair, stop_pair, tokens_of, until


@pytest.fixture(scope="module")
def lm():
    return load_model(default_model_path())


@pytest.fixture
async def pair(lm, caplog):
    p = await start_pair(lm)
    yield p
    await assert_no_leak(p, caplog)
    await stop_pair(p)


@pytest.fixture
def prompt(lm):
    return lm.tokenizer.encode(STORY)  # more than one KV block, ending in a partial one


async def test_pulled_kv_decodes_the_reference_tokens(pair, prompt):
    ref = await reference(pair.d_engine, prompt)
    res, run, tokens = await pair.prefill_then_decode("r1", prompt)
    assert tokens == ref and len(tokens) == GREEDY.max_tokens
    assert not run.kv_recomputed and pair.decode.num_kv_fallbacks == 0
    assert pair.decode.receiver.stats.transfers_ok == 1
    assert len(pair.prefill.leases) == 0  # the pull ended the lease: the prefill worker freed its blocks


async def test_without_a_handle_the_request_is_prefilled_here(pair, prompt):
    run = pair.decode.decode(DecodeJob("local", prompt, GREEDY))
    assert await tokens_of(run) == await reference(pair.d_engine, prompt)
    assert pair.decode.num_local_prefills == 1 and pair.decode.receiver.stats.transfers_ok == 0


@pytest.mark.parametrize("failure", ["released", "unreachable"])
async def test_a_failed_pull_recomputes_the_prompt_and_gives_the_same_tokens(pair, prompt, failure):
    ref = await reference(pair.d_engine, prompt)
    res = await pair.prefill.prefill("r2", prompt, GREEDY)
    handle = res.handle
    if failure == "released":  # e.g. the lease ended: TransferNotFound
        assert pair.prefill.release(handle.transfer_id)
    else:  # nobody listens there: KVTransferError
        handle = dataclasses.replace(handle, endpoint="127.0.0.1:9")
    run = pair.decode.decode(DecodeJob("r2", prompt, GREEDY, res.first_token_id, handle))
    assert [res.first_token_id] + await tokens_of(run) == ref
    assert run.kv_recomputed and pair.decode.num_kv_fallbacks == 1
    pair.prefill.release(res.handle.transfer_id)  # what the router does when it sees kv_recomputed


@pytest.mark.parametrize("failure, error", [("released", TransferNotFound), ("unreachable", KVTransferError)])
async def test_error_mode_raises_and_frees_the_reserved_blocks(pair, prompt, failure, error):
    pair.decode.transfer_failure = "error"
    res = await pair.prefill.prefill("r3", prompt, GREEDY)
    handle = res.handle
    if failure == "released":
        pair.prefill.release(handle.transfer_id)
    else:
        handle = dataclasses.replace(handle, endpoint="127.0.0.1:9")
    with pytest.raises(error):
        await tokens_of(pair.decode.decode(DecodeJob("r3", prompt, GREEDY, res.first_token_id, handle)))
    assert pair.decode.num_kv_fallbacks == 0
    pair.prefill.release(res.handle.transfer_id)


def _bad(handle, prompt, lm):
    layout = dataclasses.replace(handle.layout, block_size=handle.layout.block_size * 2)
    return {
        "no first token": (dict(first_token_id=None), InvalidRequest),
        "no endpoint": (dict(handle=dataclasses.replace(handle, endpoint="")), InvalidRequest),
        "other layout": (dict(handle=dataclasses.replace(handle, layout=layout)), KVLayoutMismatch),
        "other transport": (dict(handle=dataclasses.replace(handle, transport="ucx")), InvalidRequest),
        "short handle": (dict(handle=dataclasses.replace(handle, block_ids=handle.block_ids[:-1])), InvalidRequest),
        "other prompt": (dict(prompt_token_ids=prompt[:-1]), InvalidRequest),
        "nothing to decode": (dict(params=SamplingParams(max_tokens=1, temperature=0.0)), InvalidRequest),
        "bad first token": (dict(first_token_id=lm.config.vocab_size), InvalidRequest),
        "no request id": (dict(request_id=""), InvalidRequest),
        "first tokens disagree": (dict(first_token_ids=(7,), first_token_id=8), InvalidRequest),
        "fewer first tokens than choices": (dict(first_token_ids=(7, 8), params=SamplingParams(max_tokens=8, n=3)),
                                            InvalidRequest),
    }


async def test_bad_requests_are_refused_and_take_no_blocks(pair, prompt, lm):
    res = await pair.prefill.prefill("r4", prompt, GREEDY)
    good = DecodeJob("r4", prompt, GREEDY, res.first_token_id, res.handle)
    for name, (change, error) in _bad(res.handle, prompt, lm).items():
        with pytest.raises(error):
            await tokens_of(pair.decode.decode(dataclasses.replace(good, **change)))
            pytest.fail(name)
        stats = await pair.d_engine.stats()
        assert stats["kv_blocks_free"] == pair.d_engine.num_blocks, name
    assert pair.decode.receiver.stats.transfers_ok == 0
    assert await tokens_of(pair.decode.decode(good)) == (await reference(pair.d_engine, prompt))[1:]  # the handle still works


async def test_a_caller_cancelled_while_streaming_frees_the_blocks(pair, prompt):
    res = await pair.prefill.prefill("r5", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    run = pair.decode.decode(DecodeJob("r5", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                                       res.first_token_id, res.handle))
    got = asyncio.Event()

    async def consume():
        async for _ in run:
            got.set()

    task = asyncio.create_task(consume())
    await got.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_caller_cancelled_while_waiting_for_blocks_or_the_pull_frees_them(pair, prompt):
    res = await pair.prefill.prefill("r6", prompt, GREEDY)
    async with await pair.d_engine.allocate_blocks(pair.d_engine.num_blocks) as held:  # the pool is busy
        task = asyncio.create_task(tokens_of(pair.decode.decode(DecodeJob("r6", prompt, GREEDY, res.first_token_id, res.handle))))
        await until(lambda: _waiting(pair.d_engine), "the decode waits for KV blocks")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert held.owned
    # cancelled during the pull itself: the receiver is stopped at the fetch
    gate, fetched = asyncio.Event(), asyncio.Event()
    fetch = pair.decode.receiver.fetch

    async def slow_fetch(*args, **kwargs):
        fetched.set()
        await gate.wait()
        return await fetch(*args, **kwargs)

    pair.decode.receiver.fetch = slow_fetch
    task = asyncio.create_task(tokens_of(pair.decode.decode(DecodeJob("r6", prompt, GREEDY, res.first_token_id, res.handle))))
    await fetched.wait()
    stats = await pair.d_engine.stats()
    assert stats["kv_blocks_free"] == pair.d_engine.num_blocks - len(res.handle.block_ids)  # reserved for the pull
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pair.prefill.release(res.handle.transfer_id)


async def _waiting(engine) -> bool:
    return (await engine.stats())["kv_allocations_waiting"] == 1
