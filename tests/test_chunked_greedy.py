"""Chunked prefill computes the same thing as unchunked: greedy outputs equal token for token for prompts whose
lengths are and are not multiples of the KV block size, chunk boundaries on and off block boundaries, decodes
running in the same steps as the chunks, and n > 1 requests (one prefill, forked choices)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence

BS = 8
TEXT = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her dog Max. "
        "One day Lily and Max found a big red ball under a tree, and they played with it until the sun went down. "
        "When they came home, Mom gave them a warm bowl of soup and a hug, and Lily told her all about the ball.")


def prompts(lm, lengths: list[int]) -> list[list[int]]:
    ids = lm.tokenizer.encode(TEXT)
    assert len(ids) >= max(lengths)
    return [ids[len(ids) - n:] for n in lengths]  # different starts: different prompts


def run(lm, budget: int | None, batch: list[list[int]], arrive_at: list[int], max_tokens: int) -> tuple[dict, int]:
    """Scheduler + runner to completion (budget None: unchunked); request i joins before step ``arrive_at[i]``.
    Returns (output tokens per request, steps that mixed decodes with a prompt chunk)."""
    bm = BlockManager(256)
    cfg = SchedulerConfig(BS, 16, budget or 4096, lm.max_model_len, chunked_prefill=budget is not None)
    sched = Scheduler(cfg, bm, lm.eos_token_ids)
    runner = ModelRunner(lm, lm.model.allocate_kv_cache(256, BS), BS)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for i, p in enumerate(batch)]
    step_no = mixed = 0
    while step_no <= max(arrive_at) or sched.has_work():
        for seq, at in zip(seqs, arrive_at):
            if at == step_no:
                sched.add(seq)
        if sched.has_work():
            step, _ = sched.schedule()
            kinds = {s.num_step_tokens > 1 for s in step}
            mixed += kinds == {True, False}
            sched.postprocess(step, runner.execute(step))
        step_no += 1
    bm.check_integrity()
    assert bm.num_free == bm.num_blocks
    return {s.request_id: s.output_token_ids for s in seqs}, mixed


@pytest.mark.parametrize("budget", [8, 11, 16, 24])
def test_chunked_equals_unchunked_at_block_multiples_and_between_with_running_decodes(lm, budget):
    lengths = [5, 16, 40, 23, 8, 31, 17]  # 16, 40, 8: whole KV blocks; the others end mid-block
    arrive = [0, 0, 2, 4, 6, 9, 12]  # later prompts land while earlier ones decode
    batch = prompts(lm, lengths)
    ref, _ = run(lm, None, batch, arrive, 10)
    got, mixed = run(lm, budget, batch, arrive, 10)
    assert got == ref and all(len(v) == 10 for v in got.values())
    assert mixed >= 3  # decodes and prompt chunks really shared steps


async def test_chunked_n_greedy_choices_equal_unchunked_with_other_requests_decoding(lm):
    prompt, other = prompts(lm, [37, 12])

    async def outputs(cfg: EngineConfig) -> tuple[dict, list[int]]:
        engine = AsyncEngine(lm, cfg)
        await engine.start()
        try:
            async def choices() -> dict[int, list[int]]:
                got: dict[int, list[int]] = {}
                params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=3)
                async for out in engine.generate("n3", prompt, params):
                    got.setdefault(out.index, []).extend(out.token_ids)
                return got

            async def single() -> list[int]:
                params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
                return [t async for out in engine.generate("one", other, params) for t in out.token_ids]

            one_task = asyncio.ensure_future(single())
            await asyncio.sleep(0)  # the single request starts first and decodes while n3's prompt is chunked
            return await choices(), await one_task
        finally:
            await engine.stop()

    ref = await outputs(EngineConfig(block_size=BS, num_blocks=128))
    got = await outputs(EngineConfig(block_size=BS, num_blocks=128, enable_chunked_prefill=True, max_num_batched_tokens=9))
    assert got == ref
    choices, one = got
    assert sorted(choices) == [0, 1, 2] and all(v == choices[0] and len(v) == 12 for v in choices.values()) and len(one) == 20
