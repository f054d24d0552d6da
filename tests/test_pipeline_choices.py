"""The per-choice pipeline both front doors use (splitserve.frontend.pipeline.generate_text) over a scripted backend: each choice
has its own detokenizer and stop strings, logprobs are cut with the tokens, and the backend request is closed once
every choice has ended."""

from __future__ import annotations

from splitserve.engine.logprobs import TokenLogprob
from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.backend import TokenEvent
from splitserve.frontend.pipeline import TextDelta, generate_text


class Scripted:
    """A GenerationBackend that yields fixed events and records whether its stream was closed early."""

    def __init__(self, events: list[TokenEvent]) -> None:
        self.events = events
        self.sent = 0
        self.closed_early = False

    def generate(self, request_id, prompt_token_ids, params, deadline=None):
        async def stream():
            try:
                for ev in self.events:
                    self.sent += 1
                    yield ev
            except GeneratorExit:
                self.closed_early = self.sent < len(self.events)
                raise
        return stream()

    async def ready(self) -> bool:
        return True


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


async def test_choices_stop_on_their_own_stop_strings_and_logprobs_are_cut(tok):
    a, b = ids_of(tok, " the cat sat"), ids_of(tok, " a dog ran far")
    lps = {t: TokenLogprob(t, -float(i + 1)) for i, t in enumerate(a + b)}
    events = [TokenEvent(a, None, 0, index=0, logprobs=[lps[t] for t in a], prompt_logprobs=[None]),
              TokenEvent(b[:2], None, 0, index=1, logprobs=[lps[t] for t in b[:2]]),
              TokenEvent(a, None, 0, index=0, logprobs=[lps[t] for t in a]),  # after choice 0's stop: ignored
              TokenEvent(b[2:], "length", 0, index=1, logprobs=[lps[t] for t in b[2:]]),
              TokenEvent([7], "stop", 0, index=1)]  # never read: every choice has ended
    backend = Scripted(events)
    params = SamplingParams(max_tokens=50, n=2, logprobs=0)
    out = [d async for d in generate_text(backend, tok, "r", [1], params, stop=["cat"])]
    upto = next(k for k in range(1, len(a) + 1) if "cat" in tok.decode(a[:k]))  # tokens up to the stop string's end
    first = out[0]
    assert first.index == 0 and first.finish_reason == "stop" and first.prompt_logprobs == [None]
    assert first.text == " the " and first.token_ids == a[:upto] and upto < len(a)
    assert first.logprobs == [lps[t] for t in a[:upto]]
    assert [(d.index, d.finish_reason) for d in out[1:]] == [(1, None), (1, "length")]
    assert "".join(d.text for d in out if d.index == 1) == tok.decode(b)
    assert backend.closed_early and backend.sent == 4


async def test_a_stream_that_ends_early_aborts_the_open_choices(tok):
    backend = Scripted([TokenEvent([5], "stop", 0, index=1)])
    out = [d async for d in generate_text(backend, tok, "r", [1], SamplingParams(max_tokens=4, n=3))]
    assert out == [TextDelta(tok.decode([5]), [5], "stop", index=1), TextDelta("", [], "abort", index=0),
                   TextDelta("", [], "abort", index=2)]


async def test_a_choice_overshooting_max_tokens_is_cut_to_length(tok):
    backend = Scripted([TokenEvent([5, 6, 7], None, 0, index=0, logprobs=[TokenLogprob(t, -1.0) for t in (5, 6, 7)])])
    (d,) = [d async for d in generate_text(backend, tok, "r", [1], SamplingParams(max_tokens=2, logprobs=0))]
    assert d.token_ids == [5, 6] and d.finish_reason == "length" and [x.token_id for x in d.logprobs] == [5, 6]
