"""The planner's decisions on synthetic load signals with an injected clock (one tick per simulated second), its
latency windows over Prometheus histograms, and one tick carried out on in-process workers (SetRole over gRPC)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from prometheus_client import Histogram

from splitserve.services.router.planner import PlannerConfig, PlannerCore, PoolWorker
from splitserve.services.router.planner_loop import Planner, pool_of
from splitserve.services.router.planner_signals import HistogramWindow, Signals, bucket_quantile
from splitserve.services.router.registry import DECODE, PREFILL, WorkerRegistry
from tests.role_workers import start_role_worker


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CONFIG = PlannerConfig(slo_ttft_ms=500, slo_itl_ms=50, window_s=5, cooldown_s=20)
CALM = Signals(queued_prefill_tokens=100, running_decodes=4, ttft_s=0.1, itl_s=0.01)
PREFILL_QUEUE = dataclasses.replace(CALM, queued_prefill_tokens=20_000)  # 4.9 x the target of one prefill worker
ITL_BREACH = dataclasses.replace(CALM, itl_s=0.12)  # 2.4 x the ITL SLO


def pool(prefill: int, decode: int, elastic: bool = True) -> list[PoolWorker]:
    return ([PoolWorker(f"p{i}", PREFILL, elastic, load=i) for i in range(prefill)]
            + [PoolWorker(f"d{i}", DECODE, elastic, load=10 - i) for i in range(decode)])


def run(core: PlannerCore, clock: Clock, signals, workers: list[PoolWorker], seconds: int) -> list:
    """One tick per second for ``seconds``; ``signals``: Signals, or a function of the tick index. Flips are applied
    to ``workers`` (in place). Returns the decisions."""
    out = []
    for i in range(seconds):
        d = core.decide(signals(i) if callable(signals) else signals, workers)
        if d.action in ("flip", "revert"):
            k = next(j for j, w in enumerate(workers) if w.address == d.address)
            workers[k] = dataclasses.replace(workers[k], role=d.to_role)
        out.append(d)
        clock.t += 1
    return out


def flips(decisions) -> list[tuple[str, str, str]]:
    return [(d.address, d.from_role, d.to_role) for d in decisions if d.action == "flip"]


def test_queued_prefill_tokens_move_the_least_loaded_decode_worker_to_prefill_after_the_window():
    clock = Clock()
    core, workers = PlannerCore(CONFIG, clock), pool(1, 3)
    ds = run(core, clock, PREFILL_QUEUE, workers, 6)
    assert [d.action for d in ds] == ["wait"] * 5 + ["flip"]
    assert flips(ds) == [("d2", DECODE, PREFILL)]  # d2: the fewest running decodes
    assert ds[0].want == PREFILL and "queued prefill tokens 20000" in ds[0].reason
    assert ds[0].desired == {PREFILL: 5, DECODE: 1}  # ceil(1 x 4.88); an autoscaler's replica counts
    # the load persists: nothing more during the cool-down, then (after a new window) one more flip
    later = run(core, clock, PREFILL_QUEUE, workers, 25)
    assert {d.action for d in later[:19]} == {"cooldown"} and flips(later) == [("d1", DECODE, PREFILL)]
    assert sum(w.role == PREFILL for w in workers) == 3 and sum(w.role == DECODE for w in workers) == 1


def test_an_itl_breach_moves_a_prefill_worker_to_decode():
    clock = Clock()
    core, workers = PlannerCore(CONFIG, clock), pool(3, 1)
    ds = run(core, clock, ITL_BREACH, workers, 10)
    assert flips(ds) == [("p0", PREFILL, DECODE)]
    assert "ITL p90 120.0 ms, SLO 50 ms" in ds[0].reason and ds[0].loads[DECODE] == pytest.approx(2.4)


def test_a_signal_that_oscillates_faster_than_the_window_never_flips():
    clock = Clock()
    core = PlannerCore(CONFIG, clock)
    workers = pool(2, 2)
    # prefill pressure and decode pressure take turns every 2 s (window: 5 s); then a breach that comes and goes
    assert flips(run(core, clock, lambda i: PREFILL_QUEUE if (i // 2) % 2 else ITL_BREACH, workers, 120)) == []
    assert flips(run(core, clock, lambda i: ITL_BREACH if i % 4 else CALM, workers, 120)) == []
    assert [w.role for w in workers] == [PREFILL, PREFILL, DECODE, DECODE]


def test_no_flip_back_right_after_a_flip():
    """After moving a decode worker to prefill, the signals the new split produces do not call for the reverse."""
    clock = Clock()
    core, workers = PlannerCore(CONFIG, clock), pool(1, 3)
    run(core, clock, PREFILL_QUEUE, workers, 6)
    # two prefill workers now share the queue (load 2.4), decode has three fewer... its load rises but stays low
    after = dataclasses.replace(PREFILL_QUEUE, queued_prefill_tokens=5_000, running_decodes=30)
    ds = run(core, clock, after, workers, 120)
    assert all(d.want != DECODE for d in ds)


def test_a_flip_that_makes_the_worst_load_worse_is_undone_and_not_retried_for_a_while():
    """Workers sharing cores: one more decode worker splits the batch and the ITL gets worse, not better."""
    clock = Clock()
    core, workers = PlannerCore(CONFIG, clock), pool(3, 1)
    worse = dataclasses.replace(ITL_BREACH, itl_s=0.3)  # after the flip: 6 x the SLO instead of 2.4 x
    ds = run(core, clock, lambda i: ITL_BREACH if i < 6 else worse, workers, 26)
    assert flips(ds) == [("p0", PREFILL, DECODE)]
    revert = ds[-1]
    assert revert.action == "revert" and (revert.address, revert.from_role, revert.to_role) == ("p0", DECODE, PREFILL)
    assert "the worst load went 2.40 -> 6.00" in revert.reason and "no decode flip for 80 s" in revert.reason
    assert [w.role for w in workers] == [PREFILL, PREFILL, PREFILL, DECODE]
    # the breach goes on: a cool-down, then no decode flip until the back-off (4 cool-downs) is over, then one more try
    later = run(core, clock, ITL_BREACH, workers, 80)
    assert {d.action for d in later[:19]} == {"cooldown"} and {d.action for d in later[19:79]} == {"backoff"}
    assert flips(later) == [("p0", PREFILL, DECODE)] and later[79].action == "flip"
    # worse again: undone again, and the next back-off is twice as long
    again = run(core, clock, worse, workers, 20)
    assert again[-1].action == "revert" and "no decode flip for 160 s" in again[-1].reason


def test_a_flip_that_helps_is_kept():
    clock = Clock()
    core, workers = PlannerCore(CONFIG, clock), pool(3, 1)
    better = dataclasses.replace(ITL_BREACH, itl_s=0.04)  # 0.8 x the SLO, down from 2.4 x
    ds = run(core, clock, lambda i: ITL_BREACH if i < 6 else better, workers, 120)
    assert flips(ds) == [("p0", PREFILL, DECODE)] and "revert" not in {d.action for d in ds}
    assert [w.role for w in workers] == [DECODE, PREFILL, PREFILL, DECODE]


def test_never_empties_a_role_and_flips_only_workers_whose_role_can_change():
    clock = Clock()
    core = PlannerCore(CONFIG, clock)
    one_each = pool(1, 1)
    assert flips(run(core, clock, PREFILL_QUEUE, one_each, 60)) == []  # decode's only worker stays
    fixed = pool(1, 3, elastic=False)
    ds = run(PlannerCore(CONFIG, clock), clock, PREFILL_QUEUE, fixed, 60)
    assert flips(ds) == [] and ds[-1].action == "no_candidate"
    # a worker still draining an earlier switch is not flipped again; a down worker is neither flipped nor counted
    mixed = [PoolWorker("p0", PREFILL, True), PoolWorker("d0", DECODE, True, draining=True),
             PoolWorker("d1", DECODE, True, up=False), PoolWorker("d2", DECODE, False)]
    ds = run(PlannerCore(CONFIG, clock), clock, PREFILL_QUEUE, mixed, 60)
    assert flips(ds) == [] and ds[0].workers == {PREFILL: 1, DECODE: 2} and ds[-1].action == "no_candidate"


def test_a_role_without_workers_is_filled_at_once_after_the_window():
    clock = Clock()
    core, workers = PlannerCore(CONFIG, clock), pool(0, 3)
    ds = run(core, clock, CALM, workers, 6)
    assert flips(ds) == [("d2", DECODE, PREFILL)] and ds[0].reason == "no worker takes prefill work"


def test_both_loads_high_keeps_the_split():
    """Both kinds of work over target: moving a worker would only move the breach (the margin holds it)."""
    clock = Clock()
    both = Signals(queued_prefill_tokens=2 * 4096 * 2.0, running_decodes=2 * 48 * 1.9)
    ds = run(PlannerCore(CONFIG, clock), clock, both, pool(2, 2), 60)
    assert flips(ds) == [] and {d.action for d in ds} == {"hold"}
    assert ds[0].desired == {PREFILL: 4, DECODE: 4}


def test_config_refuses_out_of_range_knobs():
    with pytest.raises(ValueError, match="--slo-ttft-ms"):
        PlannerConfig(slo_ttft_ms=0)
    with pytest.raises(ValueError, match="--planner-window-s"):
        PlannerConfig(window_s=-1)


def test_bucket_quantile_interpolates_as_promql():
    buckets = {0.1: 0.0, 0.5: 50.0, 1.0: 100.0, math.inf: 100.0}
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.5)
    assert bucket_quantile(0.9, buckets) == pytest.approx(0.9)
    assert bucket_quantile(0.25, buckets) == pytest.approx(0.3)
    assert bucket_quantile(0.9, {0.1: 0.0, math.inf: 5.0}) == 0.1  # in the +Inf bucket: the largest finite bound
    assert bucket_quantile(0.9, {0.1: 0.0, math.inf: 0.0}) is None


def test_histogram_window_forgets_what_is_older_than_the_window():
    clock = Clock()
    h = Histogram("t_seconds", "test", ["model_name"], buckets=(0.01, 0.1, 1.0), registry=None)
    window = HistogramWindow(h, 10.0, clock)
    window.sample()
    assert window.quantile(0.9) is None
    for _ in range(10):
        h.labels("m").observe(0.5)
    clock.t += 1
    window.sample()
    assert 0.1 < window.quantile(0.9) <= 1.0
    for _ in range(12):  # 12 s of fast tokens: the slow ones leave the window
        clock.t += 1
        h.labels("m").observe(0.005)
        window.sample()
    assert window.quantile(0.9) <= 0.01


async def test_a_planner_tick_switches_a_worker_over_grpc(lm):
    workers = [await start_role_worker(lm, role) for role in (PREFILL, DECODE, DECODE)]
    registry = WorkerRegistry([], [], workers=[w.address for w in workers])
    clock = Clock()
    planner = Planner(registry, dataclasses.replace(CONFIG, window_s=0, cooldown_s=0), clock)
    try:
        await registry.poll_all()
        assert [w.role for w in pool_of(registry)] == [PREFILL, DECODE, DECODE]
        assert (await planner.tick()).action == "hold"
        next(w for w in registry.up(PREFILL)).inflight_prefill_tokens = 50_000  # as if the router had queued them
        d = await planner.tick()
        assert d.action == "flip" and d.to_role == PREFILL
        flipped = next(w for w in workers if w.address == d.address)
        assert flipped.roles.role == PREFILL  # SetRole reached the worker
        assert d.address not in [w.address for w in registry.up(DECODE)]  # and the registry follows at once
        view = planner.describe()
        assert view["flips"] == 1 and view["recent"][-1]["action"] == "flip" and view["flip_log"][0]["worker"] == d.address
        await registry.poll_all()
        assert sorted(w.role for w in pool_of(registry)) == [DECODE, PREFILL, PREFILL]
        assert (await planner.tick()).action in ("hold", "no_candidate")  # decode keeps its last worker
    finally:
        await registry.close()
        for w in workers:
            await w.stop()
