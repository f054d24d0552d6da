"""Decode migration through real engines and gRPC servers in one process (inproc KV transport, engine steps slowed
by 20 ms so the streams are surely in flight): the decode worker serving a stream stops mid-stream and every choice
continues on the other one with exactly the tokens of an uninterrupted run, over the router's gRPC front door.
Every pool is back to baseline afterwards."""

from __future__ import annotations

import pytest
from pd.v1 import common_pb2, decode_pb2

from splitserve.client import RouterClient
from splitserve.engine.faults import apply_engine_faults
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest
from splitserve.services.decode.worker import DecodeJob
from splitserve.transfer.handle import KVHandle
from tests.inproc_cluster import InprocCluster

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside"
MAX = 60


async def reference(engine, prompt: list[int], params: SamplingParams) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for o in engine.generate("reference", prompt, params):
        out.setdefault(o.index, []).extend(o.token_ids)
    return out


@pytest.fixture
async def cluster(lm):
    c = await InprocCluster(lm, num_prefill=1, num_decode=2).start()
    for w in c.decode:
        apply_engine_faults(w.engine, {"PD_FAULT_STEP_DELAY_MS": "20"})
    yield c
    await c.stop()


async def test_a_decode_worker_stopped_mid_stream_hands_every_choice_on_token_exact(cluster, lm):
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, n=2, frequency_penalty=0.5)
    want = await reference(cluster.prefill[0].engine, prompt, params)
    first = cluster.decode[0]  # round robin: the first request goes to decode-0
    got: dict[int, list[int]] = {}
    async with RouterClient(cluster.router_address) as client:
        async for r in client.generate(prompt, max_tokens=MAX, temperature=0.0, ignore_eos=True, n=2,
                                       frequency_penalty=0.5):
            got.setdefault(r.index, []).extend(r.token_ids)
            if sum(map(len, got.values())) == 8:  # both choices are decoding on decode-0: it goes away
                assert (await first.engine.stats())["requests_running"] == 2
                await first.server.stop(0)
    assert got == want
    assert cluster.backend.counters["decode_migrations"] == 2
    assert (await cluster.decode[1].servicer.GetStats(common_pb2.GetStatsRequest(), None)).counters["local_prefills"] == 2
    cluster.decode = cluster.decode[1:]  # (decode-0's server is gone; its engine is idle)
    await cluster.wait_idle()


async def test_a_decode_worker_refuses_a_resume_with_a_kv_handle(cluster, lm):
    prompt = lm.tokenizer.encode(PROMPT)
    handle = KVHandle(request_id="r", transfer_id="t", endpoint="x", transport="inproc", block_ids=(0,),
                      num_tokens=len(prompt), layout=cluster.decode[0].engine.layout, lease_ms=1000)
    job = DecodeJob("r", prompt, SamplingParams(max_tokens=8), 5, handle, None, (), (6,))
    with pytest.raises(InvalidRequest, match="resume_output_token_ids need a local prefill"):
        async for _ in cluster.decode[0].servicer.worker.decode(job):
            pass
    assert decode_pb2.DecodeRequest(resume_output_token_ids=[1, 2]).resume_output_token_ids == [1, 2]
    await cluster.wait_idle()
