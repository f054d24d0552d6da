"""The router's decode-side prefix knowledge: the prefill leg is skipped when the decode worker holds all but a few
prompt tokens (prefix_aware policy), and the decode worker holding the longest prefix is preferred."""

from __future__ import annotations

import random
from collections import Counter

from pd.v1 import common_pb2, prefill_pb2

from splitserve.engine.sampling import SamplingParams

from splitserve.services.router.backend import RoutedBackend
from splitserve.services.router.disaggregation import DisaggregationPolicy
from splitserve.services.router.policies import PrefixAware, RoundRobin
from splitserve.services.router.prefill_leg import prefill_leg
from splitserve.services.router.registry import DECODE, PREFILL, WorkerState
from tests.test_router_migration import servers  # noqa: F401  (the fixture)

B = 16


class _Stub:
    def __init__(self) -> None:
        self.calls = Counter()

    async def Prefill(self, request, timeout=None):
        self.calls["Prefill"] += 1
        return prefill_pb2.PrefillResponse(first_token_id=5)


class _Registry:
    def __init__(self, workers) -> None:
        self.workers = workers

    def up(self, role):
        return [w for w in self.workers if w.role == role]


def _w(addr, role, **kw):
    w = WorkerState(addr, role, channel=None, stub=_Stub() if role == PREFILL else None, up=True)
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def _router(policy, skip=32):
    workers = [_w("p0", PREFILL), _w("d0", DECODE), _w("d1", DECODE)]
    return RoutedBackend(_Registry(workers), policy, DisaggregationPolicy("always"), skip_prefill_tokens=skip), workers


async def test_prefill_is_skipped_only_when_decode_holds_all_but_a_few_tokens():
    router, (p0, d0, d1) = _router(PrefixAware(block_size=B, rng=random.Random(0)), skip=20)
    sampling = common_pb2.SamplingParams(max_tokens=4)
    history = list(range(100, 100 + 5 * B))  # turn 1: prompt + generated tokens, recorded on d0
    router.policy.record(d0, history)
    turn2 = history + list(range(7, 7 + 12))  # 12 new tokens: all but 12 held on d0
    assert await prefill_leg(router, "a", turn2, sampling, d0, None) is None
    assert router.counters["prefill_skipped"] == 1 and p0.stub.calls["Prefill"] == 0
    # the same prompt on a decode worker that holds nothing: prefilled remotely
    assert await prefill_leg(router, "b", turn2, sampling, d1, None) is not None
    assert p0.stub.calls["Prefill"] == 1
    # too many new tokens (more than the threshold): remote prefill, decode then pulls only the delta
    assert await prefill_leg(router, "c", history + list(range(300, 340)), sampling, d0, None) is not None
    assert router.counters["prefill_skipped"] == 1 and p0.stub.calls["Prefill"] == 2
    # the preferred decode worker is the holder
    assert all(router.pick(DECODE, turn2, set()) is d0 for _ in range(5))


async def test_no_skip_without_knowledge_or_when_off():
    router, (p0, d0, _) = _router(RoundRobin())  # round robin knows nothing about prefixes
    sampling = common_pb2.SamplingParams(max_tokens=4)
    assert await prefill_leg(router, "a", list(range(40)), sampling, d0, None) is not None
    router, (p0, d0, _) = _router(PrefixAware(block_size=B), skip=0)
    router.policy.record(d0, list(range(4 * B)))
    assert await prefill_leg(router, "b", list(range(4 * B)), sampling, d0, None) is not None
    assert router.counters["prefill_skipped"] == 0


async def test_push_leaves_a_prompt_decode_partly_holds_to_the_pull_path():
    """A push fills every prompt block; when decode holds a prefix, the pull path's delta transfer (or skip) wins."""
    from splitserve.services.router.push_leg import push_leg

    router, (p0, d0, d1) = _router(PrefixAware(block_size=B, rng=random.Random(0)), skip=0)
    router.kv_transfer_mode = "push"
    sampling = common_pb2.SamplingParams(max_tokens=4)
    history = list(range(100, 100 + 4 * B))
    router.policy.record(d0, history)
    assert await push_leg(router, "a", history + list(range(7, 7 + 40)), sampling, d0, None) is None
    assert router.counters["push_skipped_prefix_held"] == 1 and p0.stub.calls["Prefill"] == 0
    p0.kv_endpoint = ""  # d1 holds nothing: the push goes on (here: no sender endpoint known, so it stops after that check)
    assert await push_leg(router, "b", history, sampling, d1, None) is None
    assert router.counters["push_skipped_prefix_held"] == 1


async def test_what_decode_holds_is_recorded_even_when_the_consumer_stops_at_the_finish_event(servers):  # noqa: F811
    """The front door stops reading at a choice's last event: the router must have recorded the generated tokens (the
    next turn's prompt extends them) by then, or every other turn of a chat misses the prefill skip."""
    from tests.test_router_migration import LENGTH, NONE, FakeDecode, backend_of, remote

    prompt = list(range(100, 100 + 2 * B))
    out = list(range(500, 500 + B + 1))  # the first token (from prefill) and B more: B + 1 held after the last
    decode = FakeDecode([(0, t, NONE) for t in out[1:-1]] + [(0, out[-1], LENGTH)])
    backend = await backend_of(servers, remote([out[0]]), [decode], policy=PrefixAware(block_size=B))
    try:
        async for ev in backend.generate("req-1", prompt, SamplingParams(max_tokens=len(out))):
            if ev.finish_reason is not None:
                break  # as the front doors do: no further read after the last event
        d0 = backend.registry.workers[DECODE][0]
        assert backend.policy.matched_tokens(d0, prompt + out + [7] * B) == 3 * B  # prompt + generated, all but the last
    finally:
        await backend.close()
