"""Push mode (--kv-transfer-mode push) on a whole in-process deployment (real engines and gRPC, inproc KV
transport): push == pull == colocated token for token, concurrency, finishing at prefill, failures freeing
blocks on both sides."""

import asyncio
import uuid

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import PdError
from tests.inproc_cluster import InprocCluster

B = 16  # the engines' default block_size
LENGTHS = [1, B - 1, B, B + 1, 3 * B + 5]


def prompt_of(lm, n: int) -> list[int]:
    ids = lm.tokenizer.encode("Once upon a time there was a little girl who loved to play in the park with her dog. " * 4)
    return (ids * (n // len(ids) + 1))[:n]


async def run(cluster: InprocCluster, prompt, max_tokens=12, **kw) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)
    out = []
    async for ev in cluster.backend.generate(uuid.uuid4().hex, prompt, params):
        out += ev.token_ids
    return out


async def colocated(cluster: InprocCluster, prompt, max_tokens=12) -> list[int]:
    out = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for o in cluster.decode[-1].engine.generate(f"ref-{uuid.uuid4().hex}", prompt, params):
        out += o.token_ids
    return out


@pytest.fixture(params=[0, 1], ids=["per-layer", "whole-kv"])
async def push(lm, request):
    c = await InprocCluster(lm, kv_transfer_mode="push", push_layer_groups=request.param).start()
    yield c
    await c.stop()


@pytest.fixture
async def pull(lm):
    c = await InprocCluster(lm).start()
    yield c
    await c.stop()


async def test_push_equals_pull_equals_colocated(push, pull, lm):
    for n in LENGTHS:
        prompt = prompt_of(lm, n)
        pushed, pulled, ref = await run(push, prompt), await run(pull, prompt), await colocated(push, prompt)
        assert pushed == pulled == ref and len(ref) == 12, n
    stats = await push.worker_stats()
    assert stats[0]["kv_pushes"] == len(LENGTHS) and stats[0]["kv_transfers_held"] == 0
    assert stats[1]["kv_pushes_received"] == len(LENGTHS) and stats[1]["kv_bytes_received"] > 0
    assert push.backend.counters["kv_pushed"] == len(LENGTHS)
    await push.wait_idle()


async def test_concurrent_pushes(push, lm):
    prompts = [prompt_of(lm, n) for n in LENGTHS * 2]
    refs = [await colocated(push, p) for p in prompts]
    outs = await asyncio.gather(*(run(push, p) for p in prompts))
    assert outs == refs
    await push.wait_idle()


async def test_finished_at_prefill_frees_decode_blocks(push, lm):
    prompt = prompt_of(lm, B + 3)
    ref = await colocated(push, prompt, max_tokens=1)
    # max_tokens=2 with a stop token equal to the first token: the request ends at prefill
    out = await run(push, prompt, max_tokens=2, stop_token_ids=[ref[0]])
    assert out == ref
    await push.wait_idle()


async def test_invalid_prefill_fails_decode_at_once(push, lm):
    too_long = [1] * (lm.max_model_len + 5)
    with pytest.raises(PdError):
        await asyncio.wait_for(run(push, too_long), 10)
    await push.wait_idle(timeout_s=5.0)



async def test_push_landed_but_the_prefill_answer_lost_falls_back_beside_the_running_push_call(lm, monkeypatch):
    """The KV push completes (the decode worker starts decoding under the request id) but the Prefill answer never
    reaches the router (its worker died right after): the router's fallback, a local prefill on the same decode
    worker, must not collide with the dropped push call still running there (a CI run failed with "duplicate
    request_id")."""
    import grpc

    from splitserve.services.prefill.server import PrefillServicer
    answer = PrefillServicer.Prefill

    async def answer_lost(self, request, context):
        resp = await answer(self, request, context)
        if request.push_bootstrap_id:  # once the decode worker decodes the pushed KV under the request id
            for _ in range(200):
                if request.request_id in cluster[0].decode[0].engine._queues:
                    break
                await asyncio.sleep(0.01)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "answer lost")
        return resp
    monkeypatch.setattr(PrefillServicer, "Prefill", answer_lost)
    c = await InprocCluster(lm, kv_transfer_mode="push").start()
    cluster = [c]
    try:
        prompt = prompt_of(lm, 2 * B + 3)
        ref = await colocated(c, prompt, max_tokens=200)
        assert await asyncio.wait_for(run(c, prompt, max_tokens=200), 30) == ref
        assert c.backend.counters["push_prefill_failures"] == 1
        assert (await c.worker_stats())[1]["local_prefills"] == 1
        await c.wait_idle(timeout_s=10.0)
    finally:
        await c.stop()
