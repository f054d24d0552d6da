"""Prefill and decode servicers on real in-process gRPC servers with the inproc KV transport (no UCX)."""

import asyncio

import grpc
import pytest
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.rpc.server import bind, create_server
from splitserve.services.decode.server import DecodeServicer
from splitserve.services.prefill.server import PrefillServicer
from splitserve.transfer import create_receiver, create_sender
from tests.idle import engine_stats, wait_idle, wait_until


@pytest.fixture
async def workers(lm):
    """(prefill stub, decode stub, prefill servicer, prefill engine, decode engine) with a 0.3 s KV lease."""
    p_engine, d_engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=4)), AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await p_engine.start()
    await d_engine.start()
    sender = create_sender("inproc", p_engine.kv_cache, p_engine.layout)
    receiver = create_receiver("inproc", d_engine.kv_cache, d_engine.layout)
    await sender.start()
    await receiver.start()
    p_server, _ = create_server()
    d_server, _ = create_server()
    p_servicer = PrefillServicer(p_engine, sender, "inproc", lease_s=0.3)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(p_servicer, p_server)
    d_servicer = DecodeServicer(d_engine, receiver, "inproc", 5.0)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(d_servicer, d_server)
    p_port, d_port = bind(p_server, "127.0.0.1", 0), bind(d_server, "127.0.0.1", 0)
    await p_server.start()
    await d_server.start()
    p_ch, d_ch = grpc.aio.insecure_channel(f"127.0.0.1:{p_port}"), grpc.aio.insecure_channel(f"127.0.0.1:{d_port}")
    p_servicer.decode_servicer = d_servicer  # for tests that change the decode side's failure policy
    yield prefill_pb2_grpc.PrefillServiceStub(p_ch), decode_pb2_grpc.DecodeServiceStub(d_ch), p_servicer, p_engine, d_engine
    await p_ch.close()
    await d_ch.close()
    await p_server.stop(0)
    await d_server.stop(0)
    await sender.close()
    await receiver.close()
    await p_engine.stop()
    await d_engine.stop()


def sampling(max_tokens=8):
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def free_blocks(engine):
    return (await engine.stats())["kv_blocks_free"]


async def test_prefill_then_decode_equals_local_generation(workers, lm):
    prefill, decode, _, p_engine, d_engine = workers
    prompt = lm.tokenizer.encode("Once upon a time, in a small town")
    resp = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r1", prompt_token_ids=prompt, sampling=sampling()))
    assert resp.kv_handle.num_tokens == len(prompt) and resp.kv_handle.transport == "inproc"
    tokens = [resp.first_token_id]
    msgs = [m async for m in decode.Decode(decode_pb2.DecodeRequest(request_id="r1", prompt_token_ids=prompt, sampling=sampling(),
                                                                    kv_handle=resp.kv_handle, first_token_id=resp.first_token_id))]
    tokens += [t for m in msgs for t in m.token_ids]
    # the first message says how long the pull took (the router's cost model learns the handoff from it); only it
    assert msgs[0].HasField("kv_transfer_us") and 0 < msgs[0].kv_transfer_us < 60_000_000
    assert not any(m.HasField("kv_transfer_us") for m in msgs[1:])
    local_msgs = [m async for m in decode.Decode(decode_pb2.DecodeRequest(request_id="r2", prompt_token_ids=prompt, sampling=sampling()))]
    local = [t for m in local_msgs for t in m.token_ids]
    assert not any(m.HasField("kv_transfer_us") for m in local_msgs)  # a local prefill pulled nothing
    assert tokens == local and len(tokens) == 8
    await wait_idle(engine_stats(prefill=p_engine, decode=d_engine), timeout_s=2.0)


async def test_unpulled_kv_is_freed_by_lease_and_then_not_found(workers, lm):
    prefill, decode, servicer, p_engine, d_engine = workers
    prompt = lm.tokenizer.encode("Once upon a time")
    resp = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r3", prompt_token_ids=prompt, sampling=sampling()))
    assert await free_blocks(p_engine) < p_engine.num_blocks
    await wait_until("the 0.3 s KV lease expired", lambda: servicer.leases.expired == 1, timeout_s=5.0)
    await wait_idle(engine_stats(prefill=p_engine), timeout_s=2.0)
    request = decode_pb2.DecodeRequest(request_id="r3", prompt_token_ids=prompt, sampling=sampling(),
                                       kv_handle=resp.kv_handle, first_token_id=resp.first_token_id)
    # default policy (fallback): the decode worker recomputes the prompt's KV and says so on the first message
    msgs = [m async for m in decode.Decode(request)]
    assert msgs[0].kv_recomputed and not any(m.kv_recomputed for m in msgs[1:])
    assert not msgs[0].HasField("kv_transfer_us")  # no pull happened: nothing for the handoff cost model
    local = [t async for m in decode.Decode(decode_pb2.DecodeRequest(request_id="r3-local", prompt_token_ids=prompt,
                                                                     sampling=sampling())) for t in m.token_ids]
    assert [resp.first_token_id] + [t for m in msgs for t in m.token_ids] == local
    # --kv-transfer-failure error: NOT_FOUND
    servicer.decode_servicer.worker.transfer_failure = "error"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in decode.Decode(request):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await free_blocks(d_engine) == d_engine.num_blocks  # the blocks reserved for the pull were freed


async def test_release_and_max_tokens_one_hold_nothing(workers, lm):
    prefill, _, _, p_engine, _ = workers
    prompt = lm.tokenizer.encode("Once upon a time")
    one = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r4", prompt_token_ids=prompt, sampling=sampling(1)))
    assert not one.HasField("kv_handle") and one.finish_reason == common_pb2.FINISH_REASON_LENGTH
    resp = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r5", prompt_token_ids=prompt, sampling=sampling()))
    assert (await prefill.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=resp.kv_handle.transfer_id))).released
    assert not (await prefill.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=resp.kv_handle.transfer_id))).released
    await asyncio.sleep(0.05)
    assert await free_blocks(p_engine) == p_engine.num_blocks


@pytest.mark.parametrize("bad", [
    dict(prompt_token_ids=[], sampling=common_pb2.SamplingParams(max_tokens=4)),
    dict(prompt_token_ids=[1, 99999], sampling=common_pb2.SamplingParams(max_tokens=4)),
    dict(prompt_token_ids=[1, 5], sampling=common_pb2.SamplingParams(max_tokens=0)),
    dict(prompt_token_ids=[1, 5], sampling=common_pb2.SamplingParams(max_tokens=4, top_p=2.0)),
])
async def test_bad_prefill_requests_are_invalid_argument(workers, bad):
    prefill, _, _, p_engine, _ = workers
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="bad", **bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await free_blocks(p_engine) == p_engine.num_blocks


async def test_cancelled_decode_stream_frees_blocks(workers, lm):
    _, decode, _, _, d_engine = workers
    prompt = lm.tokenizer.encode("Once upon a time")
    call = decode.Decode(decode_pb2.DecodeRequest(request_id="r6", prompt_token_ids=prompt, sampling=sampling(400)))
    async for _ in call:
        break
    call.cancel()
    for _ in range(50):
        await asyncio.sleep(0.02)
        if await free_blocks(d_engine) == d_engine.num_blocks:
            break
    assert await free_blocks(d_engine) == d_engine.num_blocks
