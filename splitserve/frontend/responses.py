"""Building OpenAI response objects and stream chunks from pipeline output.

One formatter per endpoint; both expose the same methods so the HTTP app drives them
the same way. Chat streams start with a ``{"role": "assistant", "content": ""}`` delta and
end with an empty delta carrying ``finish_reason``, as OpenAI does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from splitserve.frontend.pipeline import TextDelta
from splitserve.frontend.tools import ToolPlan, ToolStream
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
    tools: ToolPlan | None = None  # chat tools: text -> tool_calls (splitserve.frontend.tools)
    _tool_stream: ToolStream | None = None

    def start_chunks(self) -> list[str]:
        """The role chunk OpenAI sends first."""
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta_chunks(self, delta: TextDelta, usage: Usage | None = None) -> list[str]:
        """A content chunk (if there is text) and a finish chunk (if finished); ``usage`` rides along if given."""
        if self.tools is not None:
            return self._tool_chunks(delta, usage)
        out = []
        if delta.text:
            out.append(self._chunk({"content": delta.text}, usage=usage))
        if delta.finish_reason is not None:
            out.append(self._chunk({}, delta.finish_reason, usage))
        return out

    def _tool_chunks(self, delta: TextDelta, usage: Usage | None) -> list[str]:
        """Chunks of a request with tools: content and ``tool_calls`` deltas from :class:`ToolStream`."""
        if self._tool_stream is None:
            self._tool_stream = self.tools.stream()
        deltas = self._tool_stream.feed(delta.text)
        finish = delta.finish_reason
        if finish is not None:
            more, finish = self._tool_stream.finish(finish)
            deltas += more
        out = [self._chunk(d, usage=usage) for d in deltas]
        if finish is not None:
            out.append(self._chunk({}, finish, usage))
        return out

    def usage_chunk(self, usage: Usage) -> str:
        """The final ``include_usage`` chunk (empty choices)."""
        obj = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return obj.model_dump_json()

    def full(self, outcome: Outcome, prompt_tokens: int) -> dict:
        """The non-streamed response body."""
        content, calls, finish = outcome.text, [], outcome.finish_reason
        if self.tools is not None:
            content, calls, finish = self.tools.parse(outcome.text, outcome.finish_reason)
        choice = ChatChoice(message=ChatResponseMessage(content=content, tool_calls=calls or None), finish_reason=finish)
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=outcome.usage(prompt_tokens)
        ).model_dump()

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None, usage: Usage | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage).model_dump_json()


ResponseFormatter = CompletionFormatter | ChatFormatter
"""Either formatter; the HTTP app drives both through the same methods."""
