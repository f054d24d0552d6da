"""Routing layer pieces in-process: policies, the disaggregation cost model, the registry's heartbeat
state machine against a real gRPC health server."""

from __future__ import annotations

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2
from pd.v1 import common_pb2, prefill_pb2_grpc

from splitserve.launcher import free_port
from splitserve.rpc.server import bind, create_server
from splitserve.services.router.config import parse
from splitserve.services.router.disaggregation import DisaggregationPolicy, LinearFit, PrefillQueue
from splitserve.services.router.policies import LeastLoaded, PrefixAware, RoundRobin, make_policy
from splitserve.services.router.registry import DECODE, PREFILL, WorkerRegistry, WorkerState


def _w(addr: str, role: str = PREFILL, **kw) -> WorkerState:
    w = WorkerState(addr, role, channel=None, stub=None, up=True)
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def test_round_robin_counts_roles_independently():
    rr = RoundRobin()
    p, d = [_w("p0"), _w("p1")], [_w("d0", DECODE), _w("d1", DECODE), _w("d2", DECODE)]
    seq = [(rr.pick(PREFILL, p, []).address, rr.pick(DECODE, d, []).address) for _ in range(6)]
    assert [s[0] for s in seq] == ["p0", "p1"] * 3
    assert [s[1] for s in seq] == ["d0", "d1", "d2"] * 2
    assert {s for s in seq} != {("p0", "d0"), ("p1", "d1")}  # not locked in pairs


def test_least_loaded_prefers_fewer_queued_tokens_and_more_free_blocks():
    ll = LeastLoaded(random.Random(0))
    p = [_w("p0", inflight_prefill_tokens=5000), _w("p1", inflight_prefill_tokens=10)]
    assert all(ll.pick(PREFILL, p, []).address == "p1" for _ in range(10))
    d = [_w("d0", DECODE, stats={"requests_running": 3, "kv_blocks_free": 10}),
         _w("d1", DECODE, stats={"requests_running": 3, "kv_blocks_free": 900})]
    assert all(ll.pick(DECODE, d, []).address == "d1" for _ in range(10))


def test_prefix_aware_follows_the_prefix_until_the_holder_is_overloaded():
    pa = PrefixAware(block_size=16, balance_slack_tokens=1000, rng=random.Random(0))
    p = [_w("p0"), _w("p1")]
    prompt = list(range(10, 330))  # 20 blocks
    pa.record(p[1], prompt)
    assert pa.matched_tokens(p[1], prompt + [5, 6]) == 320
    assert pa.matched_tokens(p[0], prompt) == 0
    assert all(pa.pick(PREFILL, p, prompt + [1]).address == "p1" for _ in range(5))
    p[1].inflight_prefill_tokens = 5000  # hot prefix: holder far busier than the other worker
    assert pa.pick(PREFILL, p, prompt).address == "p0"
    assert pa.matched_tokens(p[1], [999] + prompt) == 0  # chained: a different first block shares nothing


def test_unknown_policy_and_bad_router_flags_are_rejected():
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        parse(["--policy", "nope"])
    with pytest.raises(ValueError):
        parse(["--disagg", "sometimes"])
    assert parse(["--policy", "prefix_aware", "--disagg", "auto"]).policy == "prefix_aware"


def test_linear_fit_recovers_slope_and_intercept_and_uses_prior_first():
    f = LinearFit(slope=1.0, intercept=0.5)
    assert f.params() == (1.0, 0.5)
    for n in (100, 200, 400, 800, 1600):
        f.add(n, 0.02 + 1e-4 * n)
    slope, intercept = f.params()
    assert slope == pytest.approx(1e-4, rel=1e-3) and intercept == pytest.approx(0.02, rel=1e-2)


def test_fixed_threshold_and_always():
    assert DisaggregationPolicy("always").decide(3).local is False
    fixed = DisaggregationPolicy("64")
    assert fixed.decide(63).local and not fixed.decide(64).local
    with pytest.raises(ValueError):
        DisaggregationPolicy("maybe")


def test_auto_threshold_from_measured_costs():
    auto = _exact(DisaggregationPolicy("auto", beta=0.5, max_local_stall_s=None))
    for n in (100, 400, 1600):  # prefill workers: 1 ms/token + 10 ms; decode workers the same speed
        auto.observe_remote_prefill(n, 0.010 + 1e-3 * n)
        auto.observe_local_prefill(n, 0.010 + 1e-3 * n)
        auto.observe_transfer(n, 0.005 + 1e-5 * n)  # handoff: 5 ms + 10 us/token
    idle = auto.decide(1000, prefill_wait_s=0, decode_running=0)
    assert idle.local  # an idle decode worker is never slower than prefill + transfer
    busy = auto.decide(1000, prefill_wait_s=0, decode_running=8)
    # local = 0.01 + 1e-3 n (1 + 4); remote = 0.01 + 1e-3 n + 0.005 + 1e-5 n  ->  n* = 0.005 / (4e-3 - 1e-5)
    assert busy.threshold == pytest.approx(0.005 / (4e-3 - 1e-5), rel=0.05)
    assert not busy.local
    queued = auto.decide(1000, prefill_wait_s=20.0, decode_running=8)  # prefill queue: local wins again
    assert queued.threshold > busy.threshold and queued.local


def _exact(policy: DisaggregationPolicy) -> DisaggregationPolicy:
    """The policy with plain least squares (no anchor at the prior), for tests of the cost algebra."""
    for fit in (policy.remote_prefill, policy.local_prefill, policy.transfer):
        fit.anchor_weight = 0.0
    return policy


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_prefill_queue_waits_for_the_calls_in_flight_and_gives_service_times():
    clock = _Clock()
    q = PrefillQueue(clock)
    assert q.wait_s("p0") == 0.0
    a = q.start("p0", 1.0)
    b = q.start("p0", 0.5)  # queued behind a: starts at 101, done at 101.5
    assert q.wait_s("p0") == pytest.approx(1.5) and q.wait_s("p1") == 0.0
    clock.t += 0.4
    assert q.wait_s("p0") == pytest.approx(1.1)  # the queue drains with time
    c = q.start("p1", 0.1)  # another worker: its own queue
    clock.t += 0.8
    assert q.end(a) == (pytest.approx(1.2), pytest.approx(1.2))  # nothing ahead of a: its whole time
    assert q.wait_s("p0") == pytest.approx(0.3)  # b is still in flight
    clock.t += 0.5
    assert q.end(b) == (pytest.approx(1.7), pytest.approx(0.5))  # sent at 100, served from a's end at 101.2
    assert q.wait_s("p0") == 0.0
    assert q.end(c) == (pytest.approx(1.3), pytest.approx(1.3))
    d, e = q.start("p0", 5.0), q.start("p0", 5.0)
    clock.t += 0.25
    assert q.end(d)[1] == pytest.approx(0.25)
    assert q.end(e) == (pytest.approx(0.25), None)  # ended with d, in one engine step: no time of its own
    d, e = q.start("p0", 0.1), q.start("p0", 0.1)
    clock.t += 0.1
    q.end(d)
    clock.t += 0.004  # e's answer came a few ms after d's (one step, two streams): 4 ms is no service time of 0.1 s
    assert q.end(e) == (pytest.approx(0.104), None)
    assert q.wait_s("p0") == 0.0  # answered early: nothing of ours is queued there any more
    f, g = q.start("p0", 1.0), q.start("p0", 1.0)
    clock.t += 0.5
    assert q.end(g) == (pytest.approx(0.5), None)  # f, ahead of it, still runs: unknown
    clock.t += 0.5
    assert q.end(f)[1] == pytest.approx(1.0)


def test_auto_learns_the_prefill_cost_from_service_times_not_queue_waits():
    clock = _Clock()
    auto = _exact(DisaggregationPolicy("auto", clock=clock))
    for n in (100, 400, 1600, 800):  # alone: 10 ms + 0.5 ms/token
        call = auto.remote_started("p0", n)
        clock.t += 0.010 + 5e-4 * n
        auto.remote_finished(call, n)
    a_p, o_p = auto.remote_prefill.params()
    assert a_p == pytest.approx(5e-4, rel=1e-3) and o_p == pytest.approx(0.010, rel=1e-2)
    first, second = auto.remote_started("p0", 1000), auto.remote_started("p0", 100)  # a document, then a chat behind it
    assert auto.prefill_queue.wait_s("p0") == pytest.approx(0.010 + 0.5 + 0.010 + 0.05, rel=1e-3)
    clock.t += 0.51
    auto.remote_finished(first, 1000)
    clock.t += 0.06
    auto.remote_finished(second, 100)  # 0.57 s for 100 tokens, 0.06 s of it served: the fit takes the service time
    assert auto.remote_prefill.params() == (pytest.approx(a_p), pytest.approx(o_p))
    failed = auto.remote_started("p0", 100)
    clock.t += 3.0
    auto.remote_finished(failed, None)  # a failed call is no sample either
    assert auto.remote_prefill.params() == (pytest.approx(a_p), pytest.approx(o_p))


def test_auto_sends_a_chat_to_an_idle_prefill_worker_and_keeps_it_local_behind_a_document():
    clock = _Clock()
    auto = _exact(DisaggregationPolicy("auto", clock=clock))
    for n in (50, 200, 1000):
        call = auto.remote_started("p0", n)
        clock.t += 0.010 + 4e-4 * n  # prefill worker: 10 ms + 0.4 ms/token
        auto.remote_finished(call, n)
        auto.observe_local_prefill(n, 0.050 + 8e-4 * n)  # decode worker: a running step to wait for, a shared core
        auto.observe_transfer(n, 0.001 + 1e-6 * n)
    chat = 100
    assert not auto.decide(chat, auto.prefill_queue.wait_s("p0"), decode_running=10).local  # idle: remote
    doc = auto.remote_started("p0", 1000)  # a document now holds the prefill worker for ~0.41 s
    assert auto.decide(chat, auto.prefill_queue.wait_s("p0"), decode_running=10).local
    assert not auto.decide(1000, auto.prefill_queue.wait_s("p0"), decode_running=10).local  # documents stay remote
    clock.t += 0.41
    auto.remote_finished(doc, 1000)
    assert not auto.decide(chat, auto.prefill_queue.wait_s("p0"), decode_running=10).local


class _Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    failing = False

    async def GetStats(self, request, context):
        if self.failing:
            await context.abort(grpc.StatusCode.INTERNAL, "stats broken")
        return common_pb2.GetStatsResponse(counters={"kv_blocks_free": 7, "kv_blocks_total": 8, "requests_running": 1})

    async def GetKVLayout(self, request, context):
        return common_pb2.GetKVLayoutResponse(layout=common_pb2.KVLayout(
            model_id="m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=16, dtype="float32"))


async def test_registry_marks_a_worker_down_after_missed_heartbeats_and_up_on_recovery():
    server, health = create_server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer := _Prefill(), server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    reg = WorkerRegistry([f"127.0.0.1:{port}"], [f"127.0.0.1:{free_port()}"], poll_interval_s=0.05, miss_limit=2)
    try:
        w, dead = reg.workers[PREFILL][0], reg.workers[DECODE][0]
        await reg.poll_all()
        assert w.up and not dead.up and dead.last_error == "UNAVAILABLE"
        assert w.free_blocks == 7 and w.layout.block_size == 16
        servicer.failing = True
        assert not await reg.poll_once(w)
        assert w.up  # one missed heartbeat: still in rotation
        assert not await reg.poll_once(w)
        assert not w.up and reg.up(PREFILL) == []
        servicer.failing = False
        assert await reg.poll_once(w) and w.up  # recovered
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining for a shutdown: out at once
        assert not await reg.poll_once(w) and not w.up and "NOT_SERVING" in w.last_error
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await reg.poll_once(w) and w.up
        reg.mark_failed(w, "UNAVAILABLE")  # a request found it unreachable: out at once
        assert not w.up and reg.snapshot()[0]["state"] == "down"
        reg.start()  # the loop brings it back
        assert [x.address for x in await reg.wait_for(PREFILL, 5.0)] == [w.address]
    finally:
        await reg.close()
        await server.stop(0)


def test_auto_never_prefills_locally_what_would_stall_the_decodes_past_the_cap():
    auto = _exact(DisaggregationPolicy("auto", max_local_stall_s=0.2))
    for n in (100, 400, 1600):
        auto.observe_remote_prefill(n, 0.010 + 1e-3 * n)
        auto.observe_local_prefill(n, 0.010 + 1e-3 * n)  # 1 ms/token: the cap is 200 tokens
    assert auto.decide(150, prefill_wait_s=30.0, decode_running=8).local  # a long prefill queue: short prompts stay
    d = auto.decide(1000, prefill_wait_s=30.0, decode_running=8)
    assert not d.local and d.threshold == pytest.approx(200)  # a document would stall 8 streams for a second
    uncapped = DisaggregationPolicy("auto", max_local_stall_s=None)
    uncapped.local_prefill, uncapped.remote_prefill = auto.local_prefill, auto.remote_prefill
    assert uncapped.decide(1000, prefill_wait_s=30.0, decode_running=8).local


def test_auto_splits_a_burst_of_chats_between_the_decode_and_the_idle_prefill_worker():
    clock = _Clock()
    auto = _exact(DisaggregationPolicy("auto", clock=clock))
    for n in (50, 100, 150):  # both workers: 10 ms + 1 ms/token, alone
        auto.remote_finished(auto.remote_started("p0", n), None)  # failed calls teach nothing
        call = auto.remote_started("p0", n)
        clock.t += 0.010 + 1e-3 * n
        auto.remote_finished(call, n)
        local = auto.local_started("d0", n)
        clock.t += 0.010 + 1e-3 * n
        auto.local_finished(local, n)
    assert auto.local_prefill.params() == (pytest.approx(1e-3), pytest.approx(0.010))
    where = []
    for _ in range(8):  # eight 100-token chats at once, nothing running yet
        d = auto.decide(100, auto.prefill_queue.wait_s("p0"), 0, auto.local_queue.wait_s("d0"))
        where.append("local" if d.local else "remote")
        (auto.local_started if d.local else auto.remote_started)("d0" if d.local else "p0", 100)
    assert where.count("local") == 4 and where.count("remote") == 4  # each queue grows in turn


def test_the_anchor_keeps_a_fit_sane_when_every_sample_has_the_same_size():
    import random

    rng = random.Random(0)
    plain, anchored = LinearFit(1e-3, 0.0), LinearFit(1e-3, 0.0, anchor_weight=1.0)
    for _ in range(40):  # documents of 980..1020 tokens at 1 ms/token, their times +-10%: noise, not a slope
        n = rng.randint(980, 1020)
        y = n * 1e-3 * rng.uniform(0.9, 1.1)
        plain.add(n, y)
        anchored.add(n, y)
    slope, intercept = anchored.params()
    assert slope == pytest.approx(1e-3, rel=0.1) and intercept < 0.05
    p_slope, p_intercept = plain.params()
    assert abs(p_slope - 1e-3) > 1e-4 or p_intercept > 0.05  # least squares alone reads the noise as a line


def test_a_fit_without_a_slope_falls_back_to_a_line_through_the_origin_and_the_cap_to_the_prior():
    f = LinearFit(1e-3, 0.0)
    for n, y in ((100, 0.30), (200, 0.10), (400, 0.12)):  # noise: least squares gives a negative slope
        f.add(n, y)
    slope, intercept = f.params()
    assert slope == pytest.approx((100 * 0.30 + 200 * 0.10 + 400 * 0.12) / (100**2 + 200**2 + 400**2), rel=0.05)  # (decayed weights)
    assert intercept == 0.0
    auto = DisaggregationPolicy("auto", max_local_stall_s=0.2)
    for n in (100, 200, 400):
        auto.observe_local_prefill(n, 0.0)  # (a degenerate fit: zero seconds per token)
    assert auto.local_prefill.params()[0] == 0.0
    assert auto.decide(1000, prefill_wait_s=30.0, decode_running=8).threshold == pytest.approx(200)  # 0.2 s / 1e-3 prior
