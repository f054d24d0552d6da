"""Stall-free batching (Sarathi-Serve) through EngineCore with a fake runner: every running decode is in every
step while a long prompt is chunked, a step's tokens stay within the budget, at most one prompt is partly
prefilled at a time, and prompts are prefilled first come, first served. No model, no threads, no clock."""

from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.core import EngineCore
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence, SeqMode

BS = 4


class CheckingRunner:
    """Fake runner that records every step and checks the stall-free invariants against the scheduler's state
    at the moment the step runs. Violations are collected (EngineCore would turn an exception raised here into
    failed requests), and every test asserts there are none."""

    block_size = BS

    def __init__(self, sched: Scheduler, budget: int) -> None:
        self.sched, self.budget = sched, budget
        self.steps: list[dict[str, int]] = []
        self.violations: list[str] = []

    def execute(self, seqs: list[Sequence]) -> list[int]:
        plan = {s.request_id: s.num_step_tokens for s in seqs}
        decoding = {s.request_id for s in self.sched.running if s.num_computed_tokens >= len(s.prompt_token_ids)}
        if not decoding <= set(plan) or any(plan[r] != 1 for r in decoding):
            self.violations.append(f"step {len(self.steps)}: decodes {sorted(decoding)} not all in {plan}")
        if sum(plan.values()) > max(self.budget, len(decoding)):
            self.violations.append(f"step {len(self.steps)}: over budget {self.budget}: {plan}")
        partial = [s.request_id for s in seqs if s.is_partial_prefill]
        if len(partial) > 1:
            self.violations.append(f"step {len(self.steps)}: more than one partly prefilled prompt: {partial}")
        self.steps.append(plan)
        for s in seqs:
            s.step_results = None
        return [7] * len(seqs)


def engine(budget: int, max_num_seqs: int = 32, num_blocks: int = 512):
    sched = Scheduler(SchedulerConfig(BS, max_num_seqs, budget, 1024, chunked_prefill=True), BlockManager(num_blocks), (2,))
    runner = CheckingRunner(sched, budget)
    outputs: dict[str, list[int]] = {}

    def emit(outs) -> None:
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.token_ids)

    return EngineCore(runner, sched, emit, clock=lambda: 0.0), runner, outputs


def add(core: EngineCore, rid: str, n_prompt: int, max_tokens: int) -> None:
    core.add(Sequence(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))


def turn(core: EngineCore, n: int = 1) -> None:
    for _ in range(n):
        core.wake()
        core.run_once(stalled=True)


@pytest.mark.parametrize("budget", [16, 23, 64])
def test_every_running_decode_is_in_every_step_while_a_long_prompt_is_chunked(budget):
    core, runner, outputs = engine(budget)
    for i in range(6):
        add(core, f"d{i}", 5, max_tokens=200)
    turn(core, 3)
    assert all(len(outputs[f"d{i}"]) >= 1 for i in range(6))
    before = {i: len(outputs[f"d{i}"]) for i in range(6)}
    add(core, "doc", 300, max_tokens=4)
    first = len(runner.steps)
    for _ in range(100):
        if "doc" in outputs:
            break
        turn(core)
    chunk_steps = runner.steps[first:]
    assert len(chunk_steps) == -(-300 // (budget - 6))  # the decodes' share comes off the budget, the rest is the chunk
    for plan in chunk_steps:
        assert all(plan[f"d{i}"] == 1 for i in range(6))
    assert [p["doc"] for p in chunk_steps[:-1]] == [budget - 6] * (len(chunk_steps) - 1)
    turn(core, 4)
    assert len(outputs["doc"]) == 4 and all(len(outputs[f"d{i}"]) == before[i] + len(chunk_steps) + 4 for i in range(6))
    assert not runner.violations


def test_prompts_prefill_first_come_first_served_with_one_partial_at_a_time():
    core, runner, outputs = engine(budget=32)
    add(core, "d", 3, max_tokens=100)
    turn(core)
    for rid, n in (("long1", 70), ("short", 10), ("long2", 50)):
        add(core, rid, n, max_tokens=2)
    first_token_step = {}
    for k in range(12):
        turn(core)
        for rid in ("long1", "short", "long2"):
            if rid in outputs and rid not in first_token_step:
                first_token_step[rid] = k
    assert first_token_step["long1"] <= first_token_step["short"] <= first_token_step["long2"]
    # the short prompt rides in the step that ends long1 (the budget left over), not ahead of it
    step_of_short = next(p for p in runner.steps if "short" in p)
    assert "long1" in step_of_short and step_of_short["short"] == 10
    assert not runner.violations


def test_decodes_beyond_the_budget_all_run_and_prompts_wait():
    core, runner, outputs = engine(budget=4)
    for i in range(6):  # six running decodes (prompt KV already in place), more than the 4-token budget
        d = Sequence(f"d{i}", [10, 11, 12], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), SeqMode.DECODE_PREFILLED)
        d.output_token_ids, d.block_table, d.num_computed_tokens = [7], core.block_manager.allocate(3), 3
        core.add(d)
    add(core, "p", 8, max_tokens=2)
    turn(core, 7)  # the decodes' last tokens; the prompt waits, its blocks untouched
    assert runner.steps == [{f"d{i}": 1 for i in range(6)}] * 7 and not runner.violations
    assert [s.request_id for s in core.scheduler.waiting] == ["p"] and "p" not in outputs
    turn(core, 2)
    assert runner.steps[-2:] == [{"p": 4}, {"p": 4}] and outputs["p"] == [7]
    assert all(len(outputs[f"d{i}"]) == 7 for i in range(6))


def test_budget_is_respected_across_a_stream_of_arrivals():
    core, runner, _ = engine(budget=24)
    lengths = [5, 40, 9, 13, 64, 3, 16, 33]
    for i, n in enumerate(lengths):
        add(core, f"r{i}", n, max_tokens=6)
        turn(core, 2)
    for _ in range(200):
        if not core.scheduler.has_work():
            break
        turn(core)
    assert sum(sum(p.values()) for p in runner.steps) == sum(lengths) + sum(6 - 1 for _ in lengths)
    core.block_manager.check_integrity()
    assert core.block_manager.num_free == core.block_manager.num_blocks and not runner.violations
