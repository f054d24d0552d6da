"""Backend tokens -> text deltas per choice, for the gRPC front door (``pd.v1.GenerateResponse``).

The same rules as :func:`.pipeline.generate_text` (incremental detokenizing, stop strings, the ``max_tokens``
guard, the deadline, aborting the backend request by closing its iterator), applied to each of the request's
``params.n`` choices on its own: every choice has its own detokenizer and stop-string matcher, and its deltas carry
its ``index``, its tokens' logprobs (cut with the tokens when a stop string ends it) and, on the first delta, the
prompt's logprobs. A choice that ends on a stop string is no longer reported; the backend request is closed once
every choice has ended.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from splitserve.deadline import time_left
from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import DeadlineExceeded
from splitserve.frontend.backend import GenerationBackend, TokenEvent
from splitserve.frontend.detokenizer import IncrementalDetokenizer
from splitserve.frontend.stop import StopChecker


@dataclass(slots=True)
class ChoiceDelta:
    """New output of one choice.

    Attributes:
        index: the choice (0..n-1).
        text: new text, safe to show ("" while text is held back).
        token_ids: the choice's tokens behind it (including those of a stop string cut from the text).
        finish_reason: "stop", "length" or "abort" on the choice's last delta, else None.
        cached_tokens: prompt tokens served from a prefix cache, as known so far.
        logprobs: one per token of ``token_ids`` when the request asked for logprobs, else None.
        prompt_logprobs: the prompt's logprobs (first entry None), on the first delta of the request only.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class _Choice:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.checker = StopChecker(stop)
        self.produced = 0
        self.done = False

    def step(self, event: TokenEvent, max_tokens: int) -> tuple[str, list[int], str | None]:
        """The text, tokens and finish reason ``event`` adds to this choice."""
        ids, finish = list(event.token_ids), event.finish_reason
        if finish is None and len(ids) >= max_tokens - self.produced:  # defend against a backend overshooting
            ids, finish = ids[: max_tokens - self.produced], "length"
        pieces: list[str] = []
        for i, token_id in enumerate(ids):
            pieces.append(self.checker.feed(self.detok.step(token_id)))
            if self.checker.stopped:
                ids, finish = ids[: i + 1], "stop"
                break
        self.produced += len(ids)
        if finish is not None:
            self.done = True
            pieces.append(self.checker.flush())
        return "".join(pieces), ids, finish


async def generate_choices(
    backend: GenerationBackend, tokenizer: Any, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
    stop: Sequence[str] = (), deadline: float | None = None,
) -> AsyncIterator[ChoiceDelta]:
    """Generate the ``params.n`` choices of one request; an async generator of :class:`ChoiceDelta`.

    Each choice's last delta has its ``finish_reason`` (a backend stream that ends first leaves the open choices
    with "abort"). ``deadline``: absolute ``time.monotonic()`` time or None; once it passes the backend request is
    aborted and DeadlineExceeded raised. Backend exceptions propagate.
    """
    choices = [_Choice(tokenizer, prompt_ids, stop) for _ in range(params.n)]
    extra = {} if deadline is None else {"deadline": deadline}
    events = backend.generate(request_id, list(prompt_ids), params, **extra)
    cached = 0
    try:
        while True:
            try:
                event = await _next(events, deadline)
            except StopAsyncIteration:
                break
            cached = max(cached, event.cached_tokens)
            if not 0 <= event.index < len(choices) or choices[event.index].done:
                continue
            text, ids, finish = choices[event.index].step(event, params.max_tokens)
            logprobs = None if event.logprobs is None else list(event.logprobs[: len(ids)])
            if all(c.done for c in choices):
                await _close(events)  # abort now (stop string) or release (normal end)
            yield ChoiceDelta(event.index, text, ids, finish, cached, logprobs, event.prompt_logprobs)
            if all(c.done for c in choices):
                return
        for i, c in enumerate(choices):
            if not c.done:
                c.done = True
                yield ChoiceDelta(i, c.checker.flush(), [], "abort", cached)
    finally:
        await _close(events)


async def _next(events: Any, deadline: float | None) -> TokenEvent:
    if deadline is None:
        return await events.__anext__()
    left = time_left(deadline)
    if left <= 0:
        raise DeadlineExceeded("the request's deadline has passed")
    try:
        with anyio.fail_after(left):
            return await events.__anext__()
    except TimeoutError:
        raise DeadlineExceeded("the request's deadline passed while waiting for the backend") from None


async def _close(events: Any) -> None:
    """Close the backend iterator (aborting its request), even inside a cancelled scope."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()
