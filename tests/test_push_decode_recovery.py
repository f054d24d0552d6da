"""Push mode: a decode worker that fails after the push completed (the KV landed) but before its stream's first
message. The prefill worker no longer holds that KV, and the client already has the first token of every choice,
so the router continues the unfinished choices on another decode worker from those tokens (a migration: the new
worker recomputes prompt + first token), token-exact, within the request's deadline; with migration off the request
fails as before. In-process deployment (real engines and gRPC, inproc KV transport)."""

import uuid

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import PdError, WorkerUnavailable
from tests.inproc_cluster import InprocCluster


def prompt_of(lm) -> list[int]:
    return lm.tokenizer.encode("Once upon a time there was a little girl who loved to play in the park. " * 3)[:37]


@pytest.fixture
async def push(lm):
    c = await InprocCluster(lm, kv_transfer_mode="push", num_decode=2).start()
    yield c
    await c.stop()


def fail_after_push_once(cluster: InprocCluster) -> list[int]:
    """The next decode worker that receives a push fails right after it (before decoding); returns a list that gets
    the index of the worker that failed."""
    failed: list[int] = []
    for i, w in enumerate(cluster.decode):
        engine = w.servicer.worker.engine
        real = engine.decode_prefilled

        def decode_prefilled(*args, _i=i, _real=real, **kwargs):
            if failed:
                return _real(*args, **kwargs)
            failed.append(_i)
            raise WorkerUnavailable("the decode engine failed after the push")

        engine.decode_prefilled = decode_prefilled
    return failed


async def tokens(cluster: InprocCluster, prompt: list[int], n: int = 1) -> dict[int, list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=n)
    out: dict[int, list[int]] = {}
    async for ev in cluster.backend.generate(uuid.uuid4().hex, prompt, params):
        out.setdefault(ev.index, []).extend(ev.token_ids)
    return out


async def reference(cluster: InprocCluster, prompt: list[int]) -> list[int]:
    out = []
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    async for o in cluster.prefill[0].engine.generate(f"ref-{uuid.uuid4().hex}", prompt, params):
        out += o.token_ids
    return out


@pytest.mark.parametrize("n", [1, 2])
async def test_decode_failing_after_a_completed_push_continues_elsewhere(push, lm, n):
    prompt = prompt_of(lm)
    ref = await reference(push, prompt)
    failed = fail_after_push_once(push)
    got = await tokens(push, prompt, n)
    assert got == {i: ref for i in range(n)}  # no duplicate first token, no gap
    assert len(failed) == 1 and push.decode[failed[0]].servicer.worker.num_pushes == 1  # the KV had landed there
    assert push.backend.counters["kv_pushed"] == 1 and push.backend.counters["decode_migrations"] == n
    await push.wait_idle(timeout_s=5.0)


async def test_with_migration_off_the_request_fails(push, lm):
    push.backend.decode_migrations = 0
    failed = fail_after_push_once(push)
    with pytest.raises(PdError, match="after the push"):
        await tokens(push, prompt_of(lm))
    assert len(failed) == 1 and push.backend.counters["decode_migrations"] == 0
    await push.wait_idle(timeout_s=5.0)
