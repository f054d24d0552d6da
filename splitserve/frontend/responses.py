"""Building OpenAI response objects and stream chunks from pipeline output.

One formatter per endpoint; both expose the same methods so the HTTP app drives them
the same way. Chat streams start with a ``{"role": "assistant", "content": ""}`` delta and
end with an empty delta carrying ``finish_reason``, as OpenAI does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from splitserve.frontend.pipeline import TextDelta
from splitserve.frontend.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    Usage,
)


@dataclass
class Outcome:
    """Accumulated result of one request."""

    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None

    def add(self, delta: TextDelta) -> None:
        """Fold one delta in."""
        self.text += delta.text
        self.completion_tokens += len(delta.token_ids)
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def usage(self, prompt_tokens: int) -> Usage:
        """Usage object for this outcome."""
        return Usage.of(prompt_tokens, self.completion_tokens, self.cached_tokens)


@dataclass
class CompletionFormatter:
    """``text_completion`` objects for ``/v1/completions``."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def start_chunks(self) -> list[str]:
        """Chunks to send before the first delta (none for completions)."""
        return []

    def delta_chunks(self, delta: TextDelta, usage: Usage | None = None) -> list[str]:
        """Chunks for one delta (none when it has neither text nor a finish reason); ``usage`` rides along if given."""
        if not delta.text and delta.finish_reason is None:
            return []
        choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
        return [self._obj([choice], usage).model_dump_json()]

    def usage_chunk(self, usage: Usage) -> str:
        """The final ``include_usage`` chunk (empty choices)."""
        return self._obj([], usage).model_dump_json()

    def full(self, outcome: Outcome, prompt_tokens: int) -> dict:
        """The non-streamed response body."""
        choice = CompletionChoice(text=outcome.text, finish_reason=outcome.finish_reason)
        return self._obj([choice], outcome.usage(prompt_tokens)).model_dump()

    def _obj(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


@dataclass
class ChatFormatter:
    """``chat.completion`` / ``chat.completion.chunk`` objects for ``/v1/chat/completions``."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def start_chunks(self) -> list[str]:
        """The role chunk OpenAI sends first."""
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta_chunks(self, delta: TextDelta, usage: Usage | None = None) -> list[str]:
        """A content chunk (if there is text) and a finish chunk (if finished); ``usage`` rides along if given."""
        out = []
        if delta.text:
            out.append(self._chunk({"content": delta.text}, usage=usage))
        if delta.finish_reason is not None:
            out.append(self._chunk({}, delta.finish_reason, usage))
        return out

    def usage_chunk(self, usage: Usage) -> str:
        """The final ``include_usage`` chunk (empty choices)."""
        obj = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return obj.model_dump_json()

    def full(self, outcome: Outcome, prompt_tokens: int) -> dict:
        """The non-streamed response body."""
        choice = ChatChoice(message=ChatResponseMessage(content=outcome.text), finish_reason=outcome.finish_reason)
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=outcome.usage(prompt_tokens)
        ).model_dump()

    def _chunk(self, delta: dict[str, str], finish_reason: str | None = None, usage: Usage | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage).model_dump_json()


ResponseFormatter = CompletionFormatter | ChatFormatter
"""Either formatter; the HTTP app drives both through the same methods."""
