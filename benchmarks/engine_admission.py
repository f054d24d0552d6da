"""Cost of KV admission on every engine turn (prints numbers; not a test).

An EngineCore with a fake runner (no model: only scheduling is timed) runs 64 decodes and ``W`` more
requests waiting in the queue (``max_num_seqs`` keeps them out). Each turn (``EngineCore.run_once``:
commands, queue-bound expiry, serving waiting allocations, one scheduler step) is timed, and inside it the
step itself (``schedule`` + ``postprocess``), in the same run, so the admission share is a ratio of two
numbers measured together.

    .venv/bin/python benchmarks/engine_admission.py [--turns 400] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.core import EngineCore
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence


class FakeRunner:
    def execute(self, seqs):
        return [7] * len(seqs)


def measure(waiting: int, turns: int) -> tuple[float, float]:
    """(microseconds per turn, microseconds per step) over ``turns`` steady decode turns."""
    sched = Scheduler(SchedulerConfig(16, 64, 4096, 2048), BlockManager(64 * 40), (2,))
    core = EngineCore(FakeRunner(), sched, lambda outs: None, max_queue_len=64 + waiting + 1)
    params = SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True)
    for i in range(64 + waiting):
        core.add(Sequence(f"r{i}", list(range(3, 40)), params))
    step_s = 0.0
    inner = core._step

    def timed_step() -> bool:
        nonlocal step_s
        t = time.perf_counter()
        try:
            return inner()
        finally:
            step_s += time.perf_counter() - t

    core._step = timed_step
    for _ in range(20):  # prefill, then decodes
        core.run_once(False)
    step_s = 0.0
    t0 = time.perf_counter()
    for _ in range(turns):
        core.run_once(False)
    total = time.perf_counter() - t0
    return total / turns * 1e6, step_s / turns * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=400)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print(f"{'waiting':>8} {'turn us':>9} {'step us':>9} {'admission us':>13} {'share':>6}")
    for waiting in (0, 100, 1000):
        samples = [measure(waiting, a.turns) for _ in range(a.reps)]
        turn = statistics.median(s[0] for s in samples)
        step = statistics.median(s[1] for s in samples)
        extra = statistics.median(s[0] - s[1] for s in samples)
        print(f"{waiting:>8} {turn:>9.1f} {step:>9.1f} {extra:>13.1f} {extra / turn:>6.1%}")


if __name__ == "__main__":
    main()
