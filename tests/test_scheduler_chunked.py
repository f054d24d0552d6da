"""Chunked prefill (Sarathi-style token budget): scheduling rules, and greedy output equal to unchunked."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence, SeqMode
from splitserve.model import load_model
from splitserve.paths import default_model_path

EOS = 2


def make(budget=8, num_blocks=32, block_size=4, max_num_seqs=8, max_model_len=128):
    bm = BlockManager(num_blocks)
    cfg = SchedulerConfig(block_size, max_num_seqs, budget, max_model_len, chunked_prefill=True)
    return Scheduler(cfg, bm, (EOS,)), bm


def seq(rid, n_prompt, max_tokens=8, mode=SeqMode.GENERATE):
    return Sequence(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0), mode)


def step(s, tokens=7):
    batch, has_prefill = s.schedule()
    plan = {x.request_id: x.num_step_tokens for x in batch}
    finished = s.postprocess(batch, [tokens] * len(batch))
    return plan, has_prefill, finished


def test_long_prompt_is_split_into_budget_sized_chunks_and_samples_once():
    s, bm = make(budget=8)
    a = seq("a", 20)
    s.add(a)
    assert step(s)[:2] == ({"a": 8}, True) and a.output_token_ids == [] and a.num_computed_tokens == 8
    assert len(a.block_table) == 5  # blocks for the whole prompt reserved at admission
    assert step(s)[0] == {"a": 8} and a.output_token_ids == []
    assert step(s)[0] == {"a": 4} and a.output_token_ids == [7] and a.num_computed_tokens == 20
    plan, has_prefill, _ = step(s)
    assert plan == {"a": 1} and not has_prefill and a.output_token_ids == [7, 7]


def test_decodes_share_each_step_with_a_prompt_chunk():
    s, bm = make(budget=8)
    for rid in ("d1", "d2", "d3"):
        s.add(seq(rid, 2, max_tokens=50))
    step(s)  # the three short prompts (6 tokens) prefill together
    s.add(seq("long", 30))
    plan, has_prefill, _ = step(s)
    assert plan == {"d1": 1, "d2": 1, "d3": 1, "long": 5} and has_prefill  # running first, then a chunk
    plan, _, _ = step(s)
    assert plan == {"d1": 1, "d2": 1, "d3": 1, "long": 5}
    while s.running[-1].num_computed_tokens < 30:
        plan, _, _ = step(s)
        assert plan["d1"] == 1 and sum(plan.values()) <= 8  # decodes never stall for the long prompt
    bm.check_integrity()


def test_decodes_go_before_prompt_chunks_whatever_their_order_in_running():
    s, bm = make(budget=8, num_blocks=64)
    s.add(seq("long", 40))
    assert step(s)[0] == {"long": 8}
    d = seq("d", 3, max_tokens=50, mode=SeqMode.DECODE_PREFILLED)  # joins `running` behind the partial prompt
    d.output_token_ids, d.block_table, d.num_computed_tokens = [7], bm.allocate(1), 3
    s.add(d)
    assert [x.request_id for x in s.running] == ["long", "d"]
    for _ in range(3):
        plan, _, _ = step(s)
        assert plan == {"d": 1, "long": 7}  # the decode is never starved by the chunk


def test_budget_limits_admission_and_max_num_seqs_is_respected():
    s, bm = make(budget=8, max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add(seq(rid, 3))
    plan, _, _ = step(s)
    assert plan == {"a": 3, "b": 3} and [x.request_id for x in s.waiting] == ["c"]


def test_prefill_only_chunked_keeps_blocks_and_abort_mid_prefill_frees_them():
    s, bm = make(budget=4)
    p = seq("p", 10, mode=SeqMode.PREFILL_ONLY)
    s.add(p)
    step(s)
    step(s)
    *_, finished = step(s)
    assert finished == [p] and p.output_token_ids == [7] and len(p.block_table) == 3
    bm.free(p.block_table)
    q = seq("q", 10)
    s.add(q)
    step(s)
    assert q.num_computed_tokens == 4 and s.abort("q") is q
    assert bm.num_free == bm.num_blocks and not s.has_work()


def test_preemption_under_chunking_recomputes_from_scratch():
    s, bm = make(budget=16, num_blocks=3, block_size=2)
    a, b = seq("a", 2, max_tokens=20), seq("b", 2, max_tokens=20)
    s.add(a)
    s.add(b)
    step(s)  # each now 3 tokens: needs 2 blocks, only 1 free
    plan, _, _ = step(s)
    assert plan == {"a": 1} and list(s.waiting) == [b] and b.num_computed_tokens == 0 and b.block_table == []
    bm.check_integrity()


def _run(lm, chunked: bool, budget: int, prompts: list[list[int]], max_tokens: int, arrive_at: list[int]) -> dict[str, list[int]]:
    """Drive scheduler + runner to completion; request i is added before step ``arrive_at[i]``."""
    bs = 4
    bm = BlockManager(128)
    cfg = SchedulerConfig(bs, 16, budget if chunked else 4096, lm.max_model_len, chunked_prefill=chunked)
    sched = Scheduler(cfg, bm, lm.eos_token_ids)
    runner = ModelRunner(lm, lm.model.allocate_kv_cache(128, bs), bs)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    step_no = 0
    while step_no <= max(arrive_at) or sched.has_work():
        for i, at in enumerate(arrive_at):
            if at == step_no:
                sched.add(seqs[i])
        if sched.has_work():
            batch, _ = sched.schedule()
            sched.postprocess(batch, runner.execute(batch))
        step_no += 1
    bm.check_integrity()
    assert bm.num_free == bm.num_blocks
    return {s.request_id: s.output_token_ids for s in seqs}


@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_greedy_tokens_equal_unchunked(budget):
    lm = load_model(default_model_path())
    tok = lm.tokenizer
    texts = ["Once upon a time there was a little girl named Lily who loved to play outside in the park with her dog",
             "The cat sat", "Tom and his friend went to the big blue sea. They saw a fish and a boat and",
             "One day, a bird"]
    prompts = [tok.encode(t) for t in texts]
    arrive = [0, 0, 3, 5]  # later prompts land while earlier ones decode
    torch.manual_seed(0)
    ref = _run(lm, False, budget, prompts, 12, arrive)
    got = _run(lm, True, budget, prompts, 12, arrive)
    assert got == ref and all(len(v) == 12 for v in got.values())


async def test_async_engine_chunked_streams_same_tokens_as_unchunked():
    import asyncio

    from splitserve.engine.async_engine import AsyncEngine, EngineConfig

    lm = load_model(default_model_path())
    prompt = lm.tokenizer.encode("Once upon a time there was a little girl named Lily who loved to play outside")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def run(cfg: EngineConfig) -> tuple[list[list[int]], dict]:
        engine = AsyncEngine(lm, cfg)
        await engine.start()
        try:
            async def one(rid: str) -> list[int]:
                return [t async for out in engine.generate(rid, prompt, params) for t in out.token_ids]
            outs = await asyncio.gather(*(one(f"r{i}") for i in range(3)))
            return outs, await engine.stats()
        finally:
            await engine.stop()

    ref, _ = await run(EngineConfig(kv_cache_mb=4))
    got, stats = await run(EngineConfig(kv_cache_mb=4, max_num_batched_tokens=6, enable_chunked_prefill=True))
    assert got == ref and all(len(o) == 10 for o in got)
    assert stats["prefill_tokens"] == 3 * len(prompt) and stats["kv_blocks_free"] == stats["kv_blocks_total"]
