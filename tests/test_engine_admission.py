"""KV capacity: requests that fit the pool wait (FIFO, bounded) for blocks held elsewhere instead of failing;
requests that can never fit are refused at once. EngineCore turns driven by hand with a fake runner and an
injected clock: no thread, no model, no sleeps."""

from __future__ import annotations

import math

import pytest

from splitserve.engine.admission import max_blocks
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.core import EngineCore
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence, SeqMode
from splitserve.errors import CapacityExhausted, InvalidRequest

BS = 4
EOS = 2


class FakeRunner:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def execute(self, seqs):
        self.batches.append([s.request_id for s in seqs])
        return [7] * len(seqs)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """An EngineCore turned by hand; outputs collected per request."""

    def __init__(self, num_blocks=8, max_queue_len=16, max_queue_wait_s=10.0, chunked=False, max_model_len=64):
        self.bm = BlockManager(num_blocks)
        self.sched = Scheduler(SchedulerConfig(BS, 8, 8 if chunked else 256, max_model_len, chunked_prefill=chunked),
                               self.bm, (EOS,))
        self.clock = Clock()
        self.runner = FakeRunner()
        self.outputs: dict[str, list] = {}
        self.core = EngineCore(self.runner, self.sched, self._emit, max_queue_len, max_queue_wait_s, self.clock)

    def _emit(self, outs) -> None:
        for o in outs:
            self.outputs.setdefault(o.request_id, []).append(o)

    def turn(self, n: int = 1) -> None:
        for _ in range(n):
            self.core.wake()  # a queued command: the turn never sleeps
            self.core.run_once(stalled=True)

    def add(self, rid, n_prompt, max_tokens=4, mode=SeqMode.PREFILL_ONLY, block_table=None, computed=0) -> Sequence:
        seq = Sequence(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), mode)
        seq.block_table = list(block_table or [])
        seq.num_computed_tokens = seq.cached_tokens = computed
        self.core.add(seq)
        return seq

    def error(self, rid):
        outs = self.outputs.get(rid, [])
        return outs[-1].error if outs else None

    def first(self, rid):
        outs = [o for o in self.outputs.get(rid, []) if o.error is None]
        return outs[0] if outs else None


def test_prefill_waits_for_blocks_held_by_a_lease_then_runs_when_it_is_released():
    e = Engine(num_blocks=4)
    lease = e.core.allocate(3)  # KV held for a decode worker's pull
    e.turn()
    held = lease.result(timeout=0)
    e.add("p", 6)  # needs 2 blocks: fits the pool, not the free blocks
    e.turn(3)
    assert "p" not in e.outputs and [s.request_id for s in e.sched.waiting] == ["p"]
    e.core.free(held)  # the pull finished (or the lease expired)
    e.turn()
    out = e.first("p")
    assert out.token_ids == [7] and len(out.block_ids) == 2
    e.core.free(out.block_ids)
    e.turn()
    assert e.bm.num_free == 4
    e.bm.check_integrity()


def test_waiting_requests_keep_their_order():
    e = Engine(num_blocks=4)
    lease = e.core.allocate(3)
    e.turn()
    e.add("big", 12)  # 3 blocks
    e.add("small", 2)  # 1 block: free now, but it does not jump the queue
    e.turn(2)
    assert e.outputs == {} and [s.request_id for s in e.sched.waiting] == ["big", "small"]
    e.core.free(lease.result(timeout=0))
    e.turn()
    assert e.first("big") is not None and e.first("small") is not None
    assert e.runner.batches == [["big", "small"]]


def test_a_request_that_can_never_fit_is_refused_at_once():
    e = Engine(num_blocks=4)
    e.add("prompt", 17)  # 5 blocks > 4: a prefill that could never run
    e.add("gen", 8, max_tokens=10, mode=SeqMode.GENERATE)  # 8 + 10 - 1 = 17 tokens: 5 blocks
    e.turn()
    for rid in ("prompt", "gen"):
        assert isinstance(e.error(rid), InvalidRequest) and "whole KV pool has 4" in str(e.error(rid))
    e.add("edge", 8, max_tokens=9, mode=SeqMode.GENERATE)  # 16 tokens fed at most: exactly the pool
    e.turn(20)
    tokens = [t for o in e.outputs["edge"] for t in o.token_ids]
    assert len(tokens) == 9 and e.outputs["edge"][-1].finish_reason == "length" and e.bm.num_free == 4


def test_max_blocks_counts_the_tokens_that_are_fed():
    assert max_blocks(17, 100, 4, 512, prefill_only=True) == 5
    assert max_blocks(8, 9, 4, 512, prefill_only=False) == 4  # 16 tokens fed, the 17th is only sampled
    assert max_blocks(8, 10, 4, 512, prefill_only=False) == 5
    assert max_blocks(8, 1000, 4, 33, prefill_only=False) == 8  # stops at the context: 32 tokens fed


def test_the_wait_is_bounded_and_frees_prefix_blocks():
    e = Engine(num_blocks=4, max_queue_wait_s=10.0)
    lease = e.core.allocate(3)
    e.turn()
    cached = e.core.allocate(1)  # e.g. a prefix block read from the KV store
    e.turn()
    e.add("p", 10, block_table=cached.result(timeout=0), computed=4)  # needs 2 more blocks
    e.turn()
    assert e.core.admission.timeout() == pytest.approx(10.0)
    e.clock.now += 9.9
    e.turn()
    assert "p" not in e.outputs and e.core.admission.timeout() == pytest.approx(0.1)
    e.clock.now += 0.1
    e.turn()
    err = e.error("p")
    assert isinstance(err, CapacityExhausted) and "waited 10.0 s" in str(err) and "needs 2 more KV blocks; 0 of 4 blocks free" in str(err)
    assert not e.sched.waiting and e.bm.num_free == 1  # its prefix block is freed; only the lease is held
    assert e.core.admission.num_timed_out == 1 and e.core.admission.timeout() is None
    e.core.free(lease.result(timeout=0))
    e.turn()
    assert e.bm.num_free == 4


def test_the_queue_length_is_bounded():
    e = Engine(num_blocks=4, max_queue_len=2)
    lease = e.core.allocate(4)
    e.turn()
    for rid in ("a", "b", "c"):
        e.add(rid, 3)
    e.turn()
    assert isinstance(e.error("c"), CapacityExhausted) and "max_queue_len 2" in str(e.error("c"))
    assert e.core.admission.num_refused == 1
    extra = e.core.allocate(1)
    e.turn()
    assert isinstance(extra.exception(timeout=0), CapacityExhausted)
    e.core.free(lease.result(timeout=0))
    e.turn()
    assert e.first("a") and e.first("b")


def test_an_aborted_waiting_request_leaves_nothing_allocated():
    e = Engine(num_blocks=4)
    lease = e.core.allocate(4)
    e.turn()
    cached = e.core.allocate(1, wait=False)
    e.turn()
    assert isinstance(cached.exception(timeout=0), CapacityExhausted)  # not free now: the caller computes everything
    e.add("p", 6)
    e.turn()
    e.core.abort("p")
    e.core.free(lease.result(timeout=0))
    e.turn(2)
    assert "p" not in e.outputs and e.bm.num_free == 4 and not e.sched.has_work()


def test_allocations_wait_in_order_and_a_cancelled_one_gets_nothing():
    e = Engine(num_blocks=4)
    running = e.core.allocate(3)
    e.turn()
    first, second, third = e.core.allocate(2), e.core.allocate(1), e.core.allocate(1)
    e.turn()
    assert not (first.done() or second.done() or third.done())  # 1 block free, but the head needs 2
    assert e.core.cancel_allocation(second)  # its caller went away (e.g. the decode call was cancelled)
    e.core.free(running.result(timeout=0)[:2])
    e.turn()
    assert len(first.result(timeout=0)) == 2 and len(third.result(timeout=0)) == 1 and second.cancelled()
    assert not e.core.cancel_allocation(first)  # already served: the caller frees what it got
    e.core.free(first.result(timeout=0) + third.result(timeout=0) + running.result(timeout=0)[2:])
    e.turn()
    assert e.bm.num_free == 4 and not e.core.admission.waiters


def test_a_waiting_allocation_is_not_starved_by_later_requests():
    e = Engine(num_blocks=4)
    held = e.core.allocate(3)
    e.turn()
    incoming = e.core.allocate(2)  # blocks for incoming KV on a decode worker
    e.add("small", 2)  # 1 block is free, but it is reserved for the allocation
    e.turn()
    assert not incoming.done() and e.first("small") is None and e.sched.reserved_blocks == 2
    e.core.free(held.result(timeout=0)[:1])
    e.turn()
    assert len(incoming.result(timeout=0)) == 2 and e.sched.reserved_blocks == 0
    e.core.free(held.result(timeout=0)[1:])
    e.turn()
    assert e.first("small") is not None


def test_an_allocation_wait_is_bounded():
    e = Engine(num_blocks=4, max_queue_wait_s=5.0)
    held = e.core.allocate(4)
    e.turn()
    waiting = e.core.allocate(1)
    e.turn()
    e.clock.now += 5.0
    e.turn()
    assert isinstance(waiting.exception(timeout=0), CapacityExhausted) and "waited 5.0 s" in str(waiting.exception(timeout=0))
    too_big = e.core.allocate(5)
    e.turn()
    assert isinstance(too_big.exception(timeout=0), InvalidRequest)  # more than the whole pool: refused, never queued
    e.core.free(held.result(timeout=0))
    e.turn()
    assert e.bm.num_free == 4


def test_waiting_requests_give_up_prefix_blocks_rather_than_hold_each_other_forever():
    e = Engine(num_blocks=6)
    a_cached, b_cached = e.core.allocate(3), e.core.allocate(3)
    e.turn()
    # both hold 3 prefix blocks and need 2 more: neither could start if the other kept its blocks
    e.add("a", 20, block_table=a_cached.result(timeout=0), computed=12)
    b = e.add("b", 20, block_table=b_cached.result(timeout=0), computed=12)
    e.turn()
    assert e.first("a").cached_tokens == 12 and len(e.first("a").block_ids) == 5
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.cached_tokens == 0  # recomputes its prefix
    e.core.free(e.first("a").block_ids)
    e.turn()
    assert len(e.first("b").block_ids) == 5 and e.first("b").cached_tokens == 0
    e.core.free(e.first("b").block_ids)
    e.turn()
    assert e.bm.num_free == 6
    e.bm.check_integrity()


def test_decode_preemption_then_waiting_for_external_blocks_resumes_the_request():
    e = Engine(num_blocks=4)
    g = e.add("g", 4, max_tokens=10, mode=SeqMode.GENERATE)  # 1 block; grows to 4 blocks (13 tokens fed)
    e.turn()
    incoming = e.core.allocate(3)  # a decode worker's blocks for incoming KV take the rest of the pool
    e.turn(4)  # g needs a second block: preempted, then waits (the allocation holds the blocks)
    assert incoming.done() and g in e.sched.waiting and g.block_table == [] and e.error("g") is None
    e.core.free(incoming.result(timeout=0))
    e.turn(20)
    tokens = [t for o in e.outputs["g"] for t in o.token_ids]
    assert len(tokens) == 10 and e.outputs["g"][-1].finish_reason == "length" and e.bm.num_free == 4


@pytest.mark.parametrize("chunked", [False, True])
def test_burst_larger_than_the_pool_completes_in_fifo_order(chunked):
    e = Engine(num_blocks=6, chunked=chunked)
    for i in range(12):  # each prefill needs 2 blocks; its KV is then held (a lease) until "pulled"
        e.add(f"r{i}", 6)
    held, seen = [], set()
    for _ in range(200):
        e.turn()
        for rid, outs in e.outputs.items():
            if rid not in seen and outs[0].block_ids:
                seen.add(rid)
                held.append(outs[0].block_ids)
        if held:
            e.core.free(held.pop(0))  # one decode pull completes per turn
        if len(seen) == 12 and not held:
            break
    assert len(seen) == 12 and all(e.error(f"r{i}") is None for i in range(12))
    order = list(dict.fromkeys(rid for batch in e.runner.batches for rid in batch))  # first step of each (chunks repeat)
    assert order == [f"r{i}" for i in range(12)]
    e.turn()
    assert e.bm.num_free == 6


def test_timeout_is_none_when_unbounded():
    e = Engine(num_blocks=2, max_queue_wait_s=math.inf)
    held = e.core.allocate(2)
    e.turn()
    e.add("p", 4)
    e.turn()
    assert e.core.admission.timeout() is None
    e.clock.now += 1e9
    e.turn()
    assert "p" not in e.outputs
    e.core.free(held.result(timeout=0))
    e.turn()
    assert e.first("p") is not None
