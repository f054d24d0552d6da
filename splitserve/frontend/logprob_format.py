"""Logprob objects of the OpenAI wire format (and vLLM's ``prompt_logprobs``) built from :class:`TokenLogprob`.

* completions ``logprobs`` (legacy OpenAI): ``{tokens, token_logprobs, top_logprobs, text_offset}``, one entry
  per token; ``top_logprobs`` maps token text -> logprob for the ``k`` most likely tokens plus the chosen one
  (so up to k + 1 entries, as OpenAI's legacy API and vLLM); echoed prompt tokens come first, the very first
  with ``null`` logprob and top logprobs; ``text_offset`` is each token's character offset, counted from the
  first token shown (vLLM's convention: the sum of the token texts before it). So that each offset points at
  its token in the choice's ``text``, an echoed prompt is its tokens' text with special tokens kept (BOS
  included, as vLLM echoes a token-id prompt), not the prompt string as sent.
* chat ``logprobs``: ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] * k}],
  refusal: null}``.
* vLLM's ``prompt_logprobs``: one entry per prompt token, the first ``null``, else
  ``{"<token id>": {logprob, rank, decoded_token}}`` for the prompt token and the top ``k``.

A token's text is the tokenizer's decoding of that token alone (vLLM's "decoded token"; special tokens
included), its ``bytes`` that text's UTF-8. JSON has no infinity: a ``-inf`` logprob (a masked token) is
reported as -9999.0, as vLLM does. The logprob convention (processed logits) is in
:mod:`splitserve.engine.logprobs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob

LOGPROB_FLOOR = -9999.0
"""What a ``-inf`` logprob (or anything below) is reported as (vLLM's clamp; JSON has no infinity)."""


class MissingLogprobs(RuntimeError):
    """The backend returned no logprobs although the request asked for them (a server error, HTTP 500)."""


class CompletionLogprobs(BaseModel):
    """The ``logprobs`` object of a completions choice (one entry per token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    """One alternative of a chat token: ``token`` text, ``logprob`` and the text's UTF-8 ``bytes``."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """One chat output token with its ``k`` most likely alternatives (most likely first)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """The ``logprobs`` object of a chat choice or chunk."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class PromptLogprobEntry(BaseModel):
    """vLLM's ``Logprob``: ``logprob``, 1-based ``rank`` and ``decoded_token``."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobsJson = list[dict[str, PromptLogprobEntry] | None]
"""vLLM's ``prompt_logprobs``: per prompt token, None (the first) or token id (as a string) -> entry."""


def clamp(logprob: float) -> float:
    """``logprob`` as JSON can carry it: -inf (and NaN, which never should occur) become :data:`LOGPROB_FLOOR`."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Token id -> the text it adds in the middle of a text (special tokens kept), memoized.

    A token is decoded after a fixed anchor token and the anchor's text is cut off: decoding a token alone lets
    the decoder treat it as the start of a text (SentencePiece's Metaspace decoders strip the leading space there,
    turning "▁a" into "a"), so the pieces of a completion would not join to its text. With the anchor, the pieces
    of generated tokens join to exactly the generated text (OpenAI's ``text_offset`` arithmetic holds), as the
    incremental detokenizer produces it. A byte-fallback token that is part of a multi-byte character still
    shows as U+FFFD, as in vLLM.

    Args:
        tokenizer: a :class:`.backend.TokenizerLike` (its ``hf`` tokenizer decodes).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._hf = tokenizer.hf
        self._cache: dict[int, str] = {}
        ids = self._hf.encode("a", add_special_tokens=False).ids
        self._anchor = ids[-1:] if ids else []
        self._anchor_text = self._hf.decode(self._anchor, skip_special_tokens=False)

    def __call__(self, token_id: int, at_start: bool = False) -> str:
        """The token's text in the middle of a text, or (``at_start``) as the first token of a text (an echoed
        prompt's first token: the decoder's start-of-text rules apply, as to the echoed prompt text)."""
        if at_start:
            return self._hf.decode([token_id], skip_special_tokens=False)
        text = self._cache.get(token_id)
        if text is None:
            text = self._hf.decode([*self._anchor, token_id], skip_special_tokens=False)
            if self._anchor_text and text.startswith(self._anchor_text):
                text = text[len(self._anchor_text):]
            else:  # a decoder that merges across the anchor: the token alone
                text = self._hf.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def require(entries: Sequence[Any] | None, count: int, what: str) -> Sequence[Any]:
    """``entries`` when it holds ``count`` items; raises :class:`MissingLogprobs` otherwise."""
    if entries is None or len(entries) < count:
        have = "none" if entries is None else len(entries)
        raise MissingLogprobs(f"the backend returned {have} {what} for {count} tokens")
    return entries


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], k: int, texts: TokenTexts, offset: int = 0,
    starts_text: bool = False,
) -> CompletionLogprobs:
    """The completions ``logprobs`` object of ``token_ids`` (``entries`` aligned with them; None: no logprob,
    the first echoed prompt token). ``offset``: text offset of the first token (a stream's earlier text);
    ``starts_text``: the first token begins the text (echo), so it is decoded as a text's first token."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for i, (token_id, entry) in enumerate(zip(token_ids, entries, strict=True)):
        token = texts(token_id, at_start=starts_text and i == 0)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top = {texts(t): clamp(lp) for t, lp in reversed(entry.top[:k])}  # reversed: the likelier text wins
        top = dict(sorted(top.items(), key=lambda kv: -kv[1]))
        top.setdefault(token, clamp(entry.logprob))
        out.token_logprobs.append(clamp(entry.logprob))
        out.top_logprobs.append(top)
    return out


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=clamp(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(entries: Sequence[TokenLogprob], k: int, texts: TokenTexts) -> ChatLogprobs:
    """The chat ``logprobs`` object of generated tokens (``k``: ``top_logprobs``)."""
    content = []
    for entry in entries:
        token = texts(entry.token_id)
        alts = [_top(texts(t), lp) for t, lp in entry.top[:k]]
        content.append(ChatTokenLogprob(**_top(token, entry.logprob).model_dump(), top_logprobs=alts))
    return ChatLogprobs(content=content)


def prompt_logprobs_json(
    prompt_ids: Sequence[int], entries: PromptLogprobs, k: int, texts: TokenTexts,
) -> PromptLogprobsJson:
    """vLLM's ``prompt_logprobs`` list (``k``: the request's ``prompt_logprobs``)."""
    out: PromptLogprobsJson = []
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        ranked = {str(token_id): PromptLogprobEntry(
            logprob=clamp(entry.logprob), rank=entry.rank, decoded_token=texts(token_id))}
        for rank, (t, lp) in enumerate(entry.top[:k], start=1):
            ranked.setdefault(str(t), PromptLogprobEntry(logprob=clamp(lp), rank=rank, decoded_token=texts(t)))
        out.append(ranked)
    return out


def cumulative_logprob(entries: Sequence[TokenLogprob]) -> float:
    """Sum of the tokens' logprobs (``-inf`` when a token was masked): how ``best_of`` ranks choices."""
    return math.fsum(e.logprob for e in entries) if entries else 0.0
