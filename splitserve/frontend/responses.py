"""Building OpenAI response objects and stream chunks from pipeline output.

One formatter per endpoint; both expose the same methods so the HTTP app drives them
the same way. Chat streams start with a ``{"role": "assistant", "content": ""}`` delta per
choice and end each choice with an empty delta carrying ``finish_reason``, as OpenAI does.
Every chunk carries its choice's ``index``; usage counts the completion tokens of all choices
(with ``best_of``, of every generated choice, as OpenAI bills them). Logprob objects are
built by :mod:`.logprob_format`; what the client asked to see is a :class:`ResponseSpec`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.frontend import logprob_format as lf
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


@dataclass(frozen=True)
class ResponseSpec:
    """What the client asked to see.

    Attributes:
        n: choices returned (with ``best_of`` the backend makes more; the best ``n`` are returned).
        logprobs: alternatives per token of the ``logprobs`` object, or None for ``"logprobs": null``.
        prompt_logprobs: alternatives per prompt token of vLLM's ``prompt_logprobs``, or None (not shown).
        echo: completions: the prompt (text, and its tokens in ``logprobs``) precedes each choice's text.
        prompt_text: the echoed prompt: its tokens' text with special tokens (BOS) kept, for a text prompt as
            for token ids, so each ``text_offset`` points at its token in the text.
        echo_only: ``max_tokens: 0``: the generated token is dropped (completion_tokens 0, finish "length").
        prompt_ids: the prompt, for echo and prompt logprobs.
    """

    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False
    prompt_ids: Sequence[int] = ()
    prompt_text: str = ""


@dataclass
class ChoiceOutcome:
    """Accumulated output of one choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class Outcome:
    """Accumulated result of one request: its choices by index."""

    choices: dict[int, ChoiceOutcome] = field(default_factory=dict)
    cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: TextDelta) -> None:
        """Fold one delta in."""
        choice = self.choices.setdefault(delta.index, ChoiceOutcome())
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over all choices."""
        return sum(len(c.token_ids) for c in self.choices.values())

    def finished(self, n: int) -> bool:
        """Whether all ``n`` choices have their finish reason."""
        return len(self.choices) == n and all(c.finish_reason is not None for c in self.choices.values())


class _Formatter:
    """What both endpoints share: usage, echo-only output dropping, best_of selection, prompt logprobs."""

    id: str
    spec: ResponseSpec
    texts: lf.TokenTexts | None

    def usage(self, outcome: Outcome, prompt_tokens: int) -> Usage:
        """Usage of ``outcome`` (no completion tokens for ``max_tokens: 0``)."""
        return Usage.of(prompt_tokens, 0 if self.spec.echo_only else outcome.completion_tokens, outcome.cached_tokens)

    def _shown(self, delta: TextDelta) -> TextDelta:
        if not self.spec.echo_only:
            return delta
        finish = None if delta.finish_reason is None else "length"
        return TextDelta("", [], finish, delta.cached_tokens, delta.index, [], delta.prompt_logprobs)

    def _best(self, outcome: Outcome) -> list[ChoiceOutcome]:
        """The choices to return: all of them, or the ``n`` best by cumulative logprob (``best_of``)."""
        choices = [outcome.choices[i] for i in sorted(outcome.choices)]
        if len(choices) <= self.spec.n:
            return choices
        ranked = sorted(choices, key=lambda c: lf.cumulative_logprob(lf.require(c.logprobs, len(c.token_ids),
                                                                                 "logprobs")), reverse=True)
        return ranked[: self.spec.n]

    def _output_entries(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> list[TokenLogprob]:
        return list(lf.require(logprobs, len(token_ids), "logprobs"))[: len(token_ids)]

    def _prompt_entries(self, prompt_logprobs: PromptLogprobs | None) -> PromptLogprobs:
        return list(lf.require(prompt_logprobs, len(self.spec.prompt_ids), "prompt logprobs"))

    def _prompt_logprobs_json(self, prompt_logprobs: PromptLogprobs | None) -> lf.PromptLogprobsJson | None:
        if self.spec.prompt_logprobs is None:
            return None
        entries = self._prompt_entries(prompt_logprobs)
        return lf.prompt_logprobs_json(self.spec.prompt_ids, entries, self.spec.prompt_logprobs, self.texts)


@dataclass
class CompletionFormatter(_Formatter):
    """``text_completion`` objects for ``/v1/completions``."""

    id: str
    model: str
    spec: ResponseSpec = field(default_factory=ResponseSpec)
    texts: lf.TokenTexts | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)  # index -> text offset of its next token (stream)
    _prompt_lp: PromptLogprobs | None = None

    def start_chunks(self) -> list[str]:
        """Chunks to send before the first delta (none for completions)."""
        return []

    def delta_chunks(self, delta: TextDelta, usage: Usage | None = None) -> list[str]:
        """Chunks for one delta (none when it has no text, no tokens to show logprobs of and no finish reason);
        a choice's first chunk carries the echoed prompt; ``usage`` rides along if given."""
        delta = self._shown(delta)
        if delta.prompt_logprobs is not None:
            self._prompt_lp = delta.prompt_logprobs
        first = delta.index not in self._offsets
        echo = self.spec.echo and first
        shows_tokens = self.spec.logprobs is not None and bool(delta.token_ids)
        if not (delta.text or delta.finish_reason or shows_tokens or echo):
            return []
        text = (self.spec.prompt_text if echo else "") + delta.text
        logprobs = None
        if self.spec.logprobs is not None:
            offset = self._offsets.get(delta.index, 0)
            logprobs = self._logprobs(delta.token_ids, delta.logprobs, echo, self._prompt_lp, offset)
            self._offsets[delta.index] = offset + sum(len(t) for t in logprobs.tokens)
        else:
            self._offsets[delta.index] = 0
        choice = CompletionChoice(index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason,
                                  prompt_logprobs=self._prompt_logprobs_json(self._prompt_lp) if first else None)
        return [self._obj([choice], usage).model_dump_json()]

    def usage_chunk(self, usage: Usage) -> str:
        """The final ``include_usage`` chunk (empty choices)."""
        return self._obj([], usage).model_dump_json()

    def full(self, outcome: Outcome, prompt_tokens: int) -> dict:
        """The non-streamed response body."""
        choices = []
        for index, c in enumerate(self._best(outcome)):
            token_ids, text, finish = c.token_ids, c.text, c.finish_reason
            if self.spec.echo_only:
                token_ids, text, finish = [], "", "length"
            logprobs = None
            if self.spec.logprobs is not None:
                logprobs = self._logprobs(token_ids, c.logprobs, self.spec.echo, outcome.prompt_logprobs)
            choices.append(CompletionChoice(
                index=index, text=(self.spec.prompt_text if self.spec.echo else "") + text, logprobs=logprobs,
                finish_reason=finish, prompt_logprobs=self._prompt_logprobs_json(outcome.prompt_logprobs)))
        return self._obj(choices, self.usage(outcome, prompt_tokens)).model_dump()

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob] | None, echo: bool,
                  prompt_logprobs: PromptLogprobs | None, offset: int = 0) -> lf.CompletionLogprobs:
        """Logprobs of ``token_ids``, preceded by the echoed prompt's when ``echo``."""
        ids: list[int] = []
        entries: list[TokenLogprob | None] = []
        if echo:
            ids += list(self.spec.prompt_ids)
            entries += self._prompt_entries(prompt_logprobs)
        ids += token_ids
        entries += self._output_entries(token_ids, logprobs) if token_ids else []
        return lf.completion_logprobs(ids, entries, self.spec.logprobs or 0, self.texts, offset, starts_text=echo)

    def _obj(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


@dataclass
class ChatFormatter(_Formatter):
    """``chat.completion`` / ``chat.completion.chunk`` objects for ``/v1/chat/completions``."""

    id: str
    model: str
    spec: ResponseSpec = field(default_factory=ResponseSpec)
    texts: lf.TokenTexts | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # chat tools: text -> tool_calls (splitserve.frontend.tools)
    _tool_streams: dict[int, ToolStream] = field(default_factory=dict)  # one per choice index

    def start_chunks(self) -> list[str]:
        """The role chunk OpenAI sends first, one per choice."""
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.spec.n)]

    def delta_chunks(self, delta: TextDelta, usage: Usage | None = None) -> list[str]:
        """A content chunk (if there is text, or tokens whose logprobs to show) and a finish chunk (if finished);
        ``usage`` rides along if given. With tools, ``tool_calls`` deltas instead of content (:meth:`_tool_chunks`)."""
        if self.tools is not None:
            return self._tool_chunks(delta, usage)
        out = []
        logprobs = None
        if self.spec.logprobs is not None and delta.token_ids:
            entries = self._output_entries(delta.token_ids, delta.logprobs)
            logprobs = lf.chat_logprobs(entries, self.spec.logprobs, self.texts)
        if delta.text or logprobs is not None:
            out.append(self._chunk(delta.index, {"content": delta.text}, logprobs=logprobs, usage=usage))
        if delta.finish_reason is not None:
            out.append(self._chunk(delta.index, {}, delta.finish_reason, usage))
        return out

    def _tool_chunks(self, delta: TextDelta, usage: Usage | None) -> list[str]:
        """Chunks of a request with tools: content and ``tool_calls`` deltas from :class:`ToolStream`."""
        stream = self._tool_streams.get(delta.index)
        if stream is None:
            stream = self._tool_streams[delta.index] = self.tools.stream()
        deltas = stream.feed(delta.text)
        finish = delta.finish_reason
        if finish is not None:
            more, finish = stream.finish(finish)
            deltas += more
        out = [self._chunk(delta.index, d, usage=usage) for d in deltas]
        if finish is not None:
            out.append(self._chunk(delta.index, {}, finish, usage))
        return out

    def usage_chunk(self, usage: Usage) -> str:
        """The final ``include_usage`` chunk (empty choices)."""
        obj = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        return obj.model_dump_json()

    def full(self, outcome: Outcome, prompt_tokens: int) -> dict:
        """The non-streamed response body (vLLM's ``prompt_logprobs`` at the top level, when asked for); with tools,
        each choice's text is parsed into ``tool_calls`` (:meth:`ToolPlan.parse`)."""
        choices = []
        for index, c in enumerate(self._best(outcome)):
            logprobs = None
            if self.spec.logprobs is not None:
                entries = self._output_entries(c.token_ids, c.logprobs) if c.token_ids else []
                logprobs = lf.chat_logprobs(entries, self.spec.logprobs, self.texts)
            content, calls, finish = c.text, [], c.finish_reason
            if self.tools is not None:
                content, calls, finish = self.tools.parse(c.text, c.finish_reason)
            message = ChatResponseMessage(content=content, tool_calls=calls or None)
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish))
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=self.usage(outcome, prompt_tokens), prompt_logprobs=self._prompt_logprobs_json(outcome.prompt_logprobs),
        ).model_dump()

    def _chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None, usage: Usage | None = None,
               logprobs: lf.ChatLogprobs | None = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage).model_dump_json()


ResponseFormatter = CompletionFormatter | ChatFormatter
"""Either formatter; the HTTP app drives both through the same methods."""
