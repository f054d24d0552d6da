"""Resumed generation in the engine (decode migration): ``generate(..., resume_output_token_ids=...)`` continues a
choice from the tokens it already generated, counting them as OUTPUT. A continuation from any point gives exactly
the rest of an uninterrupted run: max_tokens left, min_tokens, presence / frequency penalties, stop token ids,
seeded draws, logprobs and the grammar matcher all continue; the same tokens fed as PROMPT instead give another
text (which shows each check can fail)."""

import asyncio

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.guided_spec import GuidedSpec
from splitserve.engine.resume import resume_sequence
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import SeqMode
from splitserve.errors import InvalidRequest

MAX = 40


@pytest.fixture
async def engine(lm):
    eng = AsyncEngine(lm, EngineConfig(block_size=4, num_blocks=256))
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture
def prompt(lm) -> list[int]:
    return lm.tokenizer.encode("Once upon a time there was a little girl named Lily")


async def run(engine, rid: str, prompt: list[int], params: SamplingParams, resume=()) -> tuple[list[int], str, list]:
    """(tokens, finish_reason, logprobs) of one n = 1 request."""
    tokens, finish, logprobs = [], None, []
    async for out in engine.generate(rid, prompt, params, resume):
        assert finish is None, "no output after the finish"
        tokens += out.token_ids
        finish = out.finish_reason
        logprobs += out.logprobs or []
    return tokens, finish, logprobs


async def assert_all_free(engine) -> None:
    def read():
        engine.block_manager.check_integrity()
        return engine.block_manager.num_free

    assert await asyncio.wrap_future(engine.core.call(read)) == engine.num_blocks


def as_prompt(params: SamplingParams, k: int) -> SamplingParams:
    """``params`` for a request that is handed the first k output tokens as prompt (the wrong way to resume)."""
    return SamplingParams(**{f: getattr(params, f) for f in params.__slots__ if f != "max_tokens"},
                          max_tokens=params.max_tokens - k)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=1.0),
    SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, repetition_penalty=1.5, bad_words_token_ids=((1161, 81),)),
    SamplingParams(max_tokens=MAX, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=MAX, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, frequency_penalty=0.5),
], ids=["greedy", "presence_frequency", "repetition_bad_words", "seeded", "seeded_top_p_penalty"])
async def test_a_continuation_from_any_point_gives_the_rest_of_the_run(engine, prompt, params):
    full, finish, _ = await run(engine, "full", prompt, params)
    assert len(full) == MAX and finish == "length"
    for k in (1, 12, MAX - 1):
        rest, rest_finish, _ = await run(engine, f"resume-{k}", prompt, params, full[:k])
        assert rest == full[k:] and rest_finish == "length", k  # max_tokens counts the resumed tokens
    await assert_all_free(engine)


async def test_the_resumed_tokens_count_as_output_not_prompt(engine, prompt):
    """Presence / frequency penalties and the seeded stream depend on the output history: the same tokens sent as
    prompt continue differently (so the equality above is not trivially true)."""
    k = 12
    for params in (SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=1.0),
                   SamplingParams(max_tokens=MAX, temperature=1.0, seed=7, ignore_eos=True)):
        full, _, _ = await run(engine, "full", prompt, params)
        wrong, _, _ = await run(engine, "as-prompt", prompt + full[:k], as_prompt(params, k))
        assert wrong != full[k:]
        assert (await run(engine, "resume", prompt, params, full[:k]))[0] == full[k:]


async def test_min_tokens_and_stop_token_ids_count_the_resumed_tokens(engine, prompt):
    greedy, _, _ = await run(engine, "greedy", prompt, SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True))
    stop = greedy[3]  # the greedy run's 4th token (first seen there) is a stop token id, banned by min_tokens until 30
    assert stop not in greedy[:3]
    params = SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, stop_token_ids=(stop,), min_tokens=30)
    full, finish, _ = await run(engine, "full", prompt, params)
    assert finish == "stop" and full[-1] == stop and 30 <= len(full) < MAX
    k = 2
    rest, rest_finish, _ = await run(engine, "resume", prompt, params, full[:k])
    assert rest == full[k:] and rest_finish == "stop"
    wrong, _, _ = await run(engine, "as-prompt", prompt + full[:k], as_prompt(params, k))  # its ban lasts 2 tokens longer
    assert wrong != full[k:]
    # a resumed history that already holds the stop token (or every max_tokens token) has nothing to continue
    for history in (full, greedy[:MAX]):
        with pytest.raises(InvalidRequest, match="already end the request"):
            engine.generate("done", prompt, params if history is full else SamplingParams(max_tokens=MAX, temperature=0), history)
    await assert_all_free(engine)


async def test_logprobs_continue(engine, prompt):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2, frequency_penalty=0.5)
    full, _, full_lps = await run(engine, "full", prompt, params)
    k = 10
    rest, _, rest_lps = await run(engine, "resume", prompt, params, full[:k])
    assert rest == full[k:] and len(rest_lps) == len(rest)
    for got, want in zip(rest_lps, full_lps[k:]):
        assert got.token_id == want.token_id and got.rank == want.rank
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)  # the recomputed logits differ in the last bits
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


async def test_the_grammar_matcher_is_replayed_over_the_resumed_tokens(engine, prompt, lm):
    params = SamplingParams(max_tokens=30, temperature=0, guided=GuidedSpec("regex", "( [a-z]+)+"))
    full, finish, _ = await run(engine, "full", prompt, params)
    assert len(full) > 4
    k = 3
    rest, rest_finish, _ = await run(engine, "resume", prompt, params, full[:k])
    assert rest == full[k:] and rest_finish == finish
    comma = lm.tokenizer.encode(",", add_special_tokens=False)[-1]
    with pytest.raises(InvalidRequest, match="grammar"):
        engine.generate("bad", prompt, params, full[:k] + [comma])
    await assert_all_free(engine)


async def test_bad_resumes_are_refused_before_anything_is_allocated(engine, prompt, lm):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with pytest.raises(InvalidRequest, match="n must be 1"):
        engine.generate("n2", prompt, SamplingParams(max_tokens=8, temperature=0, n=2), [5])
    with pytest.raises(InvalidRequest, match="must be in"):
        engine.generate("vocab", prompt, params, [lm.config.vocab_size])
    with pytest.raises(InvalidRequest, match="already end"):
        engine.generate("length", prompt, params, [5] * 8)
    with pytest.raises(InvalidRequest, match="already end"):  # prompt + history reach the context
        engine.generate("context", prompt, SamplingParams(max_tokens=engine.max_model_len, temperature=0, ignore_eos=True),
                        [5] * (engine.max_model_len - len(prompt)))
    await assert_all_free(engine)


def test_resume_sequence_seeds_the_output_history():
    params = SamplingParams(max_tokens=10, temperature=0)
    seq = resume_sequence("r", [1, 2, 3], params, (7, 8), 100, lambda p, t, n, total: None, None)
    assert seq.mode is SeqMode.GENERATE and seq.prompt_token_ids == [1, 2, 3] and seq.output_token_ids == [7, 8]
    assert seq.num_computed_tokens == 0 and seq.num_new_tokens == 5  # prompt + output are prefilled; next index 2
    seen = []
    resume_sequence("r", [1, 2, 3], params, (7, 8), 100, lambda p, t, n, total: seen.append((t, n, total)), None)
    assert seen == [(7, 1, 4), (8, 2, 5)]  # the stop rule sees each token at its output index
