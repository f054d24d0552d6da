"""Test doubles for the front end: a tokenizer wrapper, a model info and a scripted backend.

Meant for tests of the front end and of anything built on it (router, CLI). Production
code uses the real tokenizer wrapper and engines.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from splitserve.engine.logprobs import TokenLogprob
from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.backend import TokenEvent


class SimpleTokenizer:
    """A minimal TokenizerLike over a ``tokenizers.Tokenizer``.

    ``encode`` prepends the BOS id when ``add_special_tokens`` (like ``add_bos_token``);
    ``decode`` drops special ids itself (``skip_special_tokens`` in ``tokenizers`` misses
    specials of some converted SentencePiece models).
    """

    def __init__(
        self,
        hf: Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = [hf.token_to_id(eos_token)] if eos_token else []
        added = hf.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special} | set(self.eos_token_ids)

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> SimpleTokenizer:
        """Load ``tokenizer.json`` from ``path``."""
        return cls(Tokenizer.from_file(path), **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to ids, with BOS first when ``add_special_tokens`` (GIL released while tokenizing)."""
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids to text."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


@dataclass
class SimpleModelInfo:
    """A ModelInfo: served ``name``, ``tokenizer`` and ``max_model_len``."""

    name: str
    tokenizer: Any
    max_model_len: int = 512


Script = Sequence[int] | Callable[[list[int], SamplingParams], Sequence[int]]


def fake_logprob(token_id: int, k: int) -> TokenLogprob:
    """The fake backend's logprob of ``token_id`` with ``k`` alternatives: the token is the most likely one
    (rank 1, logprob ``-(token_id % 13 + 1) / 8``), followed by tokens ``token_id + j`` (j = 1..k-1), each one
    nat less likely than the one before."""
    lp = -((token_id % 13) + 1) / 8
    top = tuple((token_id + j, lp - j) for j in range(k))
    return TokenLogprob(token_id, lp, 1, top)


@dataclass
class ScriptedBackend:
    """A GenerationBackend yielding scripted token ids, recording what happened.

    Args:
        script: token ids to produce, or a function ``(prompt_ids, params) -> ids`` (called once per choice
            with ``params.for_choice(i)``, so a seed differs per choice).
        choices: per-choice scripts for ``params.n`` > 1 (choice i plays ``choices[i % len(choices)]``);
            None: every choice plays ``script``.
        eos_token_ids: ids that finish with "stop" (unless ``params.ignore_eos``).
        delay: seconds to sleep before each event.
        tokens_per_event: ids per TokenEvent.
        cached_tokens: reported on every event.
        error_before_first: raised when the first event is requested.
        error_after: ``(n, exc)``: raise ``exc`` after ``n`` events.
        is_ready: what ``ready()`` returns.

    The choices' events interleave round-robin (choice 0, 1, ..., n-1, 0, ...), each with its ``index``.
    With ``params.logprobs`` every event carries :func:`fake_logprob` of its tokens; with
    ``params.prompt_logprobs`` the first event carries the prompt's (None, then :func:`fake_logprob`).

    Records: ``calls`` (request_id, prompt_ids, params), ``aborted`` (request ids whose
    generator was closed or cancelled before finishing), ``finished`` (ran to the end),
    ``deadlines`` (the deadline each call got).
    """

    script: Script = ()
    choices: Sequence[Sequence[int]] | None = None
    eos_token_ids: Sequence[int] = (2,)
    delay: float = 0.0
    tokens_per_event: int = 1
    cached_tokens: int = 0
    error_before_first: BaseException | None = None
    error_after: tuple[int, BaseException] | None = None
    is_ready: bool = True
    calls: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    deadlines: list[float | None] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def ready(self) -> bool:
        """Returns ``is_ready``."""
        return self.is_ready

    def _tokens(self, prompt_ids: list[int], params: SamplingParams, index: int) -> list[int]:
        if self.choices is not None:
            return list(self.choices[index % len(self.choices)])
        return list(self.script(prompt_ids, params.for_choice(index)) if callable(self.script) else self.script)

    def _choice_events(self, tokens: list[int], params: SamplingParams, index: int) -> list[TokenEvent]:
        """The events of one choice, honouring max_tokens and stop ids."""
        events: list[TokenEvent] = []
        out: list[int] = []
        for i, tok in enumerate(tokens):
            out.append(tok)
            finish = None
            if (tok in self.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                finish = "stop"
            elif i + 1 >= params.max_tokens:
                finish = "length"
            if finish is None and len(out) < self.tokens_per_event and i + 1 < len(tokens):
                continue
            if finish is None and i + 1 == len(tokens):
                finish = "stop"  # script exhausted: behave as if EOS
            logprobs = None if params.logprobs is None else [fake_logprob(t, params.logprobs) for t in out]
            events.append(TokenEvent(out, finish, self.cached_tokens, index, logprobs))
            out = []
            if finish is not None:
                break
        return events

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Yield the scripted tokens of each choice as interleaved TokenEvents."""
        self.calls.append((request_id, list(prompt_token_ids), params))
        self.deadlines.append(deadline)
        self.started.set()
        per_choice = [self._choice_events(self._tokens(list(prompt_token_ids), params, i), params, i)
                      for i in range(params.n)]
        ordered = [e for step in itertools.zip_longest(*per_choice) for e in step if e is not None]
        if ordered and params.prompt_logprobs is not None:
            k = params.prompt_logprobs
            ordered[0].prompt_logprobs = [None] + [fake_logprob(t, k) for t in prompt_token_ids[1:]]
        done = False
        try:
            if self.error_before_first is not None:
                raise self.error_before_first
            for events, event in enumerate(ordered):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.error_after is not None and events == self.error_after[0]:
                    raise self.error_after[1]
                done = events + 1 == len(ordered)
                if done:
                    self.finished.add(request_id)
                yield event
        finally:
            if not done:
                self.aborted.add(request_id)
