"""The one generation pipeline behind every API: backend tokens -> text deltas.

Used by the HTTP app (completions and chat) and by the router's gRPC API. It runs the
backend, detokenizes incrementally, applies stop strings, and aborts the backend request
(by closing its iterator) on a stop-string match, on an error or when the consumer
closes this generator (client disconnect).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from splitserve.deadline import time_left
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import DeadlineExceeded
from splitserve.frontend.backend import GenerationBackend
from splitserve.frontend.detokenizer import IncrementalDetokenizer
from splitserve.frontend.stop import StopChecker


@dataclass(slots=True)
class TextDelta:
    """New output of one step.

    Attributes:
        text: new text, safe to show (may be "" while text is held back).
        token_ids: the tokens generated in this step (completion tokens to count;
            includes the tokens of a stop string that was cut from the text).
        finish_reason: "stop", "length" or "abort" on the last delta, else None.
        cached_tokens: prompt tokens served from a prefix cache, as known so far
            (the value on the last delta is final).
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0


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

    The last delta has ``finish_reason`` set: "stop" (EOS, a stop token id or a stop
    string, whose text is excluded), "length" (``params.max_tokens`` tokens) or "abort"
    (the backend ended without a finish reason). On a stop-string match the backend
    iterator is closed before the final delta is yielded. Backend exceptions propagate.

    ``deadline`` (absolute ``time.monotonic()`` time, or None) is handed to the backend, which
    gives each hop the time left; it is also enforced here: once it passes, the backend
    request is aborted and :class:`splitserve.errors.DeadlineExceeded` is raised.
    """
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    checker = StopChecker(stop)
    extra = {} if deadline is None else {"deadline": deadline}  # backends without deadlines keep working
    events = backend.generate(request_id, list(prompt_ids), params, **extra)
    produced = 0
    cached = 0
    try:
        while True:
            try:
                event = await _next(events, deadline)
            except StopAsyncIteration:
                break
            cached = max(cached, event.cached_tokens)
            ids = list(event.token_ids)
            finish = event.finish_reason
            remaining = params.max_tokens - produced
            if finish is None and len(ids) >= remaining:  # defend against a backend overshooting
                ids, finish = ids[:remaining], "length"
            pieces: list[str] = []
            for i, token_id in enumerate(ids):
                pieces.append(checker.feed(detok.step(token_id)))
                if checker.stopped:
                    ids, finish = ids[: i + 1], "stop"
                    break
            produced += len(ids)
            if finish is not None:
                await _close(events)  # abort now (stop string) or release (normal end)
                pieces.append(checker.flush())
                yield TextDelta("".join(pieces), ids, finish, cached)
                return
            yield TextDelta("".join(pieces), ids, None, cached)
        yield TextDelta(checker.flush(), [], "abort", cached)
    finally:
        await _close(events)


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
