"""generate_text: detokenize + stop strings + token counting + aborting the backend."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import WorkerUnavailable
from splitserve.frontend.pipeline import TextDelta, generate_text
from splitserve.frontend.testing import ScriptedBackend, SimpleTokenizer
from tests.idle import wait_until

STORY = "Once upon a time, there was a little girl named Lily. She liked to play outside."


async def collect(agen) -> list[TextDelta]:
    return [d async for d in agen]


def story_ids(tok: SimpleTokenizer) -> list[int]:
    return tok.encode(STORY, add_special_tokens=False)


async def test_full_run_until_eos(tok: SimpleTokenizer) -> None:
    gen = story_ids(tok)
    backend = ScriptedBackend(script=[*gen, 2], cached_tokens=3)
    deltas = await collect(generate_text(backend, tok, "r1", [1], SamplingParams(max_tokens=100), []))
    assert "".join(d.text for d in deltas) == STORY
    assert sum(len(d.token_ids) for d in deltas) == len(gen) + 1  # EOS counts as a completion token
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].cached_tokens == 3
    assert backend.finished == {"r1"} and not backend.aborted


async def test_length_finish(tok: SimpleTokenizer) -> None:
    backend = ScriptedBackend(script=story_ids(tok))
    deltas = await collect(generate_text(backend, tok, "r", [1], SamplingParams(max_tokens=4), []))
    assert sum(len(d.token_ids) for d in deltas) == 4
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == tok.decode(story_ids(tok)[:4])


@pytest.mark.parametrize("per_event", [1, 3])
async def test_stop_string_spanning_tokens_cuts_counts_and_aborts(tok: SimpleTokenizer, per_event: int) -> None:
    gen = story_ids(tok)
    stop = "little girl named"
    backend = ScriptedBackend(script=[*gen, 2], tokens_per_event=per_event)
    deltas = await collect(generate_text(backend, tok, "s", [1], SamplingParams(max_tokens=100), [stop]))
    text = "".join(d.text for d in deltas)
    assert text == STORY[: STORY.index(stop)]
    # the stop string spans several tokens; count the tokens up to the one completing it
    n_stop = next(n for n in range(1, len(gen) + 1) if stop in tok.decode(gen[:n]))
    assert sum(len(d.token_ids) for d in deltas) == n_stop
    assert tok.decode(gen[:n_stop - 1]).find(stop) == -1
    for d in deltas:  # no delta ever contains a piece of the stop string's occurrence
        assert "little" not in d.text and "girl" not in d.text
    assert deltas[-1].finish_reason == "stop"
    assert backend.aborted == {"s"} and not backend.finished


async def test_backend_error_propagates_and_backend_is_closed(tok: SimpleTokenizer) -> None:
    backend = ScriptedBackend(script=story_ids(tok), error_after=(2, WorkerUnavailable("decode died")))
    agen = generate_text(backend, tok, "e", [1], SamplingParams(max_tokens=100), [])
    got = []
    with pytest.raises(WorkerUnavailable):
        async for d in agen:
            got.append(d)
    assert len(got) == 2 and backend.aborted == {"e"}


async def test_consumer_aclose_aborts_backend(tok: SimpleTokenizer) -> None:
    backend = ScriptedBackend(script=story_ids(tok))
    agen = generate_text(backend, tok, "c", [1], SamplingParams(max_tokens=100), [])
    await agen.__anext__()
    await agen.aclose()
    assert backend.aborted == {"c"}


async def test_cancellation_aborts_backend(tok: SimpleTokenizer) -> None:
    backend = ScriptedBackend(script=story_ids(tok), delay=0.05)
    task = asyncio.ensure_future(collect(generate_text(backend, tok, "x", [1], SamplingParams(max_tokens=100), [])))
    await wait_until("the backend is generating", backend.started.is_set, timeout_s=5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.aborted == {"x"}


async def test_backend_overshooting_max_tokens_is_cut(tok: SimpleTokenizer) -> None:
    class Greedy(ScriptedBackend):
        async def generate(self, request_id, prompt_token_ids, params):
            from splitserve.frontend.backend import TokenEvent

            yield TokenEvent(story_ids(tok)[:10])  # ignores max_tokens and never finishes

    deltas = await collect(generate_text(Greedy(), tok, "g", [1], SamplingParams(max_tokens=3), []))
    assert [d.token_ids for d in deltas] == [story_ids(tok)[:3]] and deltas[-1].finish_reason == "length"


async def test_backend_ending_without_finish_reports_abort(tok: SimpleTokenizer) -> None:
    deltas = await collect(generate_text(ScriptedBackend(script=[]), tok, "a", [1], SamplingParams(), []))
    assert deltas == [TextDelta("", [], "abort", 0)]
