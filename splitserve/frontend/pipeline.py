"""The one generation pipeline behind every API: backend tokens -> text deltas.

Used by the HTTP app (completions and chat) and by the router's gRPC API. It runs the
backend, demultiplexes the ``n`` choices of a request (``TokenEvent.index``), detokenizes each
incrementally, applies stop strings per choice, and aborts the backend request (by closing its
iterator) once every choice is over, on an error or when the consumer closes this generator
(client disconnect).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from splitserve.deadline import time_left
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import DeadlineExceeded
from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.frontend.backend import GenerationBackend, TokenEvent
from splitserve.frontend.detokenizer import IncrementalDetokenizer
from splitserve.frontend.stop import StopChecker


@dataclass(slots=True)
class TextDelta:
    """New output of one step of one choice.

    Attributes:
        text: new text, safe to show (may be "" while text is held back).
        token_ids: the tokens generated in this step (completion tokens to count;
            includes the tokens of a stop string that was cut from the text).
        finish_reason: "stop", "length" or "abort" on the choice's last delta, else None.
        cached_tokens: prompt tokens served from a prefix cache, as known so far
            (the value on the last delta is final).
        index: the choice (0..n-1).
        logprobs: one :class:`TokenLogprob` per token of ``token_ids`` when ``params.logprobs`` is set.
        prompt_logprobs: the prompt's logprobs (first entry None) on the first delta of the request, when
            ``params.prompt_logprobs`` is set.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class _Choice:
    """Per-choice state: detokenizer, stop strings, token budget."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str], index: int) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.checker = StopChecker(stop)
        self.index = index
        self.produced = 0
        self.done = False

    def step(self, event: TokenEvent, max_tokens: int) -> TextDelta:
        """The delta of one backend event of this choice (``done`` once it finished)."""
        ids = list(event.token_ids)
        finish = event.finish_reason
        remaining = max_tokens - self.produced
        if finish is None and len(ids) >= remaining:  # defend against a backend overshooting
            ids, finish = ids[:remaining], "length"
        pieces: list[str] = []
        for i, token_id in enumerate(ids):
            pieces.append(self.checker.feed(self.detok.step(token_id)))
            if self.checker.stopped:
                ids, finish = ids[: i + 1], "stop"
                break
        self.produced += len(ids)
        if finish is not None:
            pieces.append(self.checker.flush())
            self.done = True
        logprobs = None if event.logprobs is None else list(event.logprobs[: len(ids)])
        return TextDelta("".join(pieces), ids, finish, index=self.index, logprobs=logprobs)

    def abort(self) -> TextDelta:
        """The last delta of a choice the backend left unfinished."""
        self.done = True
        return TextDelta(self.checker.flush(), [], "abort", index=self.index)


async def generate_text(
    backend: GenerationBackend,
    tokenizer: Any,
    request_id: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stop: Sequence[str] = (),
    deadline: float | None = None,
) -> AsyncIterator[TextDelta]:
    """Generate text for one request; an async generator of :class:`TextDelta`.

    With ``params.n`` > 1 the choices' deltas interleave (``index``); each choice has its own detokenizer,
    stop strings and budget. Each choice's last delta has ``finish_reason`` set: "stop" (EOS, a stop token
    id or a stop string, whose text is excluded), "length" (``params.max_tokens`` tokens) or "abort" (the
    backend ended without finishing it). A choice that matched a stop string is over: the backend's later
    tokens of that choice are ignored. Once every choice is over, the backend iterator is closed (aborting
    what is left) before the final delta is yielded. Backend exceptions propagate.

    ``deadline`` (absolute ``time.monotonic()`` time, or None) is handed to the backend, which
    gives each hop the time left; it is also enforced here: once it passes, the backend
    request is aborted and :class:`splitserve.errors.DeadlineExceeded` is raised.

    Raises:
        BackendProtocolError: an event names a choice outside 0..n-1.
    """
    choices = [_Choice(tokenizer, prompt_ids, stop, i) for i in range(params.n)]
    extra = {} if deadline is None else {"deadline": deadline}  # backends without deadlines keep working
    events = backend.generate(request_id, list(prompt_ids), params, **extra)
    cached = 0
    prompt_logprobs: PromptLogprobs | None = None
    first = True
    try:
        while True:
            try:
                event = await _next(events, deadline)
            except StopAsyncIteration:
                break
            cached = max(cached, event.cached_tokens)
            if event.prompt_logprobs is not None:
                prompt_logprobs = event.prompt_logprobs
            if not 0 <= event.index < len(choices):
                raise BackendProtocolError(f"the backend sent choice {event.index} of a request with n={params.n}")
            choice = choices[event.index]
            if choice.done:
                continue
            delta = choice.step(event, params.max_tokens)
            delta.cached_tokens = cached
            if first:
                delta.prompt_logprobs, first = prompt_logprobs, False
            if all(c.done for c in choices):
                await _close(events)  # abort now (stop string) or release (normal end)
                yield delta
                return
            yield delta
        for choice in choices:
            if not choice.done:
                delta = choice.abort()
                delta.cached_tokens = cached
                yield delta
    finally:
        await _close(events)


class BackendProtocolError(RuntimeError):
    """The backend broke the :class:`GenerationBackend` contract (a server error, HTTP 500)."""


async def _next(events: Any, deadline: float | None) -> Any:
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
