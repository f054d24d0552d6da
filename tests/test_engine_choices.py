"""n > 1 in the engine: one prefill, n forked sequences sharing the prompt's full KV blocks (refcounts) with a
copy-on-write partial last block; per-choice seeds (seed + i); every block freed after finish and after abort."""

import asyncio
import contextlib

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest

BS = 4


@pytest.fixture
async def engine(lm):
    eng = AsyncEngine(lm, EngineConfig(block_size=BS, num_blocks=256))
    await eng.start()
    yield eng
    await eng.stop()


async def collect(stream) -> dict[int, list]:
    """Outputs per choice index: (token_ids..., finish_reason) flattened into tokens plus the last reason."""
    by_index: dict[int, list] = {}
    async for out in stream:
        entry = by_index.setdefault(out.index, [[], None])
        assert entry[1] is None, "no output after a choice finished"
        entry[0] += out.token_ids
        entry[1] = out.finish_reason
    return by_index


async def tokens(engine, rid, prompt, params) -> dict[int, list[int]]:
    got = await collect(engine.generate(rid, prompt, params))
    assert all(reason is not None for _, reason in got.values())
    return {i: toks for i, (toks, _) in got.items()}


async def assert_all_free(engine) -> None:
    def read():
        engine.block_manager.check_integrity()
        return engine.block_manager.num_free

    assert await asyncio.wrap_future(engine.core.call(read)) == engine.num_blocks


def prompt_of(lm, length: int) -> list[int]:
    ids = lm.tokenizer.encode("Once upon a time there was a little girl named Lily who loved to play in the park with her dog")
    assert len(ids) >= length
    return ids[:length]


async def test_n4_greedy_gives_four_equal_choices_equal_to_n1(engine, lm):
    prompt = prompt_of(lm, 10)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = (await tokens(engine, "one", prompt, params))[0]
    got = await tokens(engine, "four", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=4))
    assert sorted(got) == [0, 1, 2, 3]
    assert all(got[i] == ref for i in range(4)) and len(ref) == 24
    await assert_all_free(engine)


@pytest.mark.parametrize("length", [2 * BS, 2 * BS + 3, BS - 1])
async def test_seeded_choices_equal_n1_requests_with_seed_plus_i(engine, lm, length):
    """Choices draw different tokens, so a fork that shared (not copied) the partial last block, or wrote into a
    shared full block, would change them: choice i must equal the n = 1 request seeded seed + i, token for token."""
    prompt = prompt_of(lm, length)
    base = dict(max_tokens=20, temperature=1.0, ignore_eos=True)
    got = await tokens(engine, "n4", prompt, SamplingParams(**base, seed=1234, n=4))
    refs = [(await tokens(engine, f"ref{i}", prompt, SamplingParams(**base, seed=1234 + i)))[0] for i in range(4)]
    assert [got[i] for i in range(4)] == refs
    assert len({tuple(r) for r in refs}) > 1  # the choices really differ
    again = await tokens(engine, "n4-again", prompt, SamplingParams(**base, seed=1234, n=4))
    assert again == got
    await assert_all_free(engine)


@pytest.mark.parametrize("length", [2 * BS, 2 * BS + 1])
async def test_decode_prefilled_forks_a_prefill_of_another_engine_shape(engine, lm, length):
    """The disaggregated path inside one engine: prefill(n=3) then decode_prefilled with its first tokens."""
    prompt = prompt_of(lm, length)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, n=3)
    pre = await engine.prefill("p", prompt, params)
    assert len(pre.first_token_ids) == 3 and pre.finish_reasons == [None] * 3 and pre.first_token_id == pre.first_token_ids[0]
    async with pre.blocks as blocks:
        got = await collect(engine.decode_prefilled("p", prompt, params, pre.first_token_ids, blocks))
    full = await tokens(engine, "g", prompt, params)
    assert {i: [pre.first_token_ids[i]] + toks for i, (toks, _) in got.items()} == full
    await assert_all_free(engine)


async def test_closing_the_stream_aborts_every_choice_and_frees_all_blocks(engine, lm):
    prompt = prompt_of(lm, 2 * BS + 2)
    stream = engine.generate("x", prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=1, ignore_eos=True, n=4))
    seen = 0
    async with contextlib.aclosing(stream):
        async for _ in stream:
            seen += 1
            if seen == 10:  # the 4 first tokens, then decode outputs of the forks
                break
    await assert_all_free(engine)
    stats = await engine.stats()
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0


async def test_a_choice_that_ends_at_its_first_token_is_finished_while_others_continue(engine, lm):
    prompt = prompt_of(lm, 7)
    base = dict(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True, n=3)
    first = (await engine.prefill("probe", prompt, SamplingParams(**base))).first_token_ids
    assert len(set(first)) > 1, "pick another seed: the choices' first tokens must differ"
    pre = await engine.prefill("probe2", prompt, SamplingParams(**base, stop_token_ids=(first[1],)))
    pre.blocks.free()
    assert pre.first_token_ids == first
    assert [r == "stop" for r in pre.finish_reasons] == [t == first[1] for t in first] and pre.finish_reason is None
    got = await collect(engine.generate("gen", prompt, SamplingParams(**base, stop_token_ids=(first[1],))))
    assert got[1] == [[first[1]], "stop"]
    assert all(reason is not None for _, reason in got.values())
    await assert_all_free(engine)


async def test_every_choice_ending_at_prefill_returns_no_blocks(engine, lm):
    prompt = prompt_of(lm, 6)
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3, n=3)
    pre = await engine.prefill("p", prompt, params)
    assert pre.blocks is None and pre.finish_reasons == ["length"] * 3 and pre.finish_reason == "length"
    got = await collect(engine.generate("g", prompt, params))
    assert {i: toks for i, (toks, _) in got.items()} == {i: [t] for i, t in enumerate(pre.first_token_ids)}
    with pytest.raises(InvalidRequest):
        async with await engine.allocate_blocks(2) as blocks:
            engine.decode_prefilled("d", prompt, params, pre.first_token_ids, blocks)
    await assert_all_free(engine)


async def test_decode_prefilled_checks_one_first_token_per_choice(engine, lm):
    prompt = prompt_of(lm, 6)
    async with await engine.allocate_blocks(2) as blocks:
        with pytest.raises(InvalidRequest):
            engine.decode_prefilled("d", prompt, SamplingParams(n=3), [1, 2], blocks)
    await assert_all_free(engine)


async def test_forks_preempted_for_lack_of_blocks_recompute_and_free_everything(lm):
    """4 choices of 40 tokens need ~46 blocks; the pool has 30: children are preempted (dropping their share of the
    prompt blocks) and recomputed, and still equal the n = 1 output."""
    eng = AsyncEngine(lm, EngineConfig(block_size=BS, num_blocks=30))
    await eng.start()
    try:
        prompt = prompt_of(lm, 10)
        ref = (await tokens(eng, "one", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))[0]
        got = await tokens(eng, "four", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=4))
        assert [got[i] for i in range(4)] == [ref] * 4
        assert eng.core.num_prefill_tokens > 2 * len(prompt)  # preempted children recomputed their prompt
        await assert_all_free(eng)
    finally:
        await eng.stop()


async def test_colocated_backend_events_carry_index_and_logprobs(engine, lm):
    from splitserve.colocated.backend import LocalBackend

    prompt = prompt_of(lm, 6)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=8, ignore_eos=True, n=2, logprobs=1, prompt_logprobs=0)
    events = [e async for e in LocalBackend(engine).generate("c", prompt, params)]
    assert {e.index for e in events} == {0, 1}
    assert all(e.logprobs is not None and len(e.logprobs) == len(e.token_ids) for e in events)
    assert len(events[0].prompt_logprobs) == len(prompt) and all(e.prompt_logprobs is None for e in events[1:])
    assert sum(len(e.token_ids) for e in events) == 8
    await assert_all_free(engine)
