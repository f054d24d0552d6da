"""The prefill -> decode handoff of n choices, as the workers see the engine (``AsyncEngine``).

A prefill samples the first token of every choice (``PrefillOutput.first_token_ids``, n of them, with their
logprobs and the prompt's logprobs when asked); the decode worker continues all n from their first tokens
(``AsyncEngine.decode_prefilled(..., first_token_ids, ...)``).

Transitional: an engine built before issue 14 knows a single ``first_token_id``. These helpers accept both, so the
workers run with either engine; with the old one a request with n > 1 is refused (InvalidRequest). Once every
engine has ``first_token_ids`` the fallbacks here can go.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import AsyncIterator

from splitserve.engine.async_engine import AsyncEngine, PrefillOutput
from splitserve.engine.core import RequestOutput
from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class PrefillChoices:
    """What a prefill produced for each of the request's n choices.

    Attributes:
        first_token_ids: choice i's first token at index i (n entries).
        first_logprobs: their TokenLogprobs (aligned), or None when ``params.logprobs`` is unset.
        prompt_logprobs: one entry per prompt token (the first None), or None when ``params.prompt_logprobs`` is unset.
        finish_reasons: per choice (aligned), set when that choice ended with its first token.
    """

    first_token_ids: tuple[int, ...]
    first_logprobs: tuple[TokenLogprob, ...] | None
    prompt_logprobs: PromptLogprobs | None
    finish_reasons: tuple[str | None, ...]


def prefill_choices(out: PrefillOutput) -> PrefillChoices:
    """The choices of ``out``. An engine without n gives one choice whose finish reason is the request's."""
    ids = getattr(out, "first_token_ids", None)
    ids = (out.first_token_id,) if ids is None else tuple(ids)
    lps = getattr(out, "first_logprobs", None)
    reasons = getattr(out, "finish_reasons", None)
    if reasons is None or len(reasons) != len(ids):
        reasons = (out.finish_reason,) * len(ids)  # the request's reason is every choice's (None: none ended)
    return PrefillChoices(ids, None if lps is None else tuple(lps), getattr(out, "prompt_logprobs", None), tuple(reasons))


def _first_arg(engine: AsyncEngine, first_token_ids: list[int]) -> int | list[int]:
    """What ``check_decode`` / ``decode_prefilled`` take: the list (an engine with n), else the one token."""
    if "first_token_ids" in inspect.signature(engine.decode_prefilled).parameters:
        return list(first_token_ids)
    if len(first_token_ids) != 1:
        raise InvalidRequest(f"this decode worker's engine continues one choice; got {len(first_token_ids)} first tokens")
    return first_token_ids[0]


def check_decode(engine: AsyncEngine, prompt_token_ids: list[int], params: SamplingParams, first_token_ids: list[int]) -> None:
    """``engine.check_decode`` for n first tokens. Raises InvalidRequest."""
    engine.check_decode(prompt_token_ids, params, _first_arg(engine, first_token_ids))


def decode_prefilled(engine: AsyncEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     first_token_ids: list[int], blocks: OwnedBlocks,
                     num_computed_tokens: int | None = None) -> AsyncIterator[RequestOutput]:
    """``engine.decode_prefilled`` continuing every choice from its first token (see ``AsyncEngine``)."""
    first = _first_arg(engine, first_token_ids)
    return engine.decode_prefilled(request_id, prompt_token_ids, params, first, blocks, num_computed_tokens)
