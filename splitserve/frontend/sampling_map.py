"""A front door's :class:`.prepare.SamplingRequest` -> the engine's :class:`SamplingParams`.

Errors are :class:`.errors.APIError` 400s naming the request field (``param``) that holds the bad value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.errors import APIError

_PARAMS = {f.name for f in fields(SamplingParams)}
_FIELD_OF = {"bad_words_token_ids": "bad_words"}  # SamplingParams field -> request field


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences for ``bad_words``, as vLLM builds them (``SamplingParams.update_from_tokenizer``).

    Each word (leading whitespace stripped) is encoded without special tokens as is, and once more with a
    leading space, which is kept when it gives a different first token and the same number of tokens (so
    a word is banned both at the start of the text and after a space).

    Raises:
        APIError: 400 ``bad_words`` for a word that encodes to no tokens.
    """
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise APIError(f"Invalid value for 'bad_words': {word!r} encodes to no tokens.", param="bad_words")
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def build_params(sampling: Any, max_tokens: int, bad_words: tuple[tuple[int, ...], ...]) -> SamplingParams:
    """:class:`SamplingParams` from a :class:`.prepare.SamplingRequest` whose budget (``max_tokens``) and
    bad words (token ids) are resolved.

    Raises:
        APIError: 400 naming the field SamplingParams refused (e.g. ``min_tokens`` above ``max_tokens``).
    """
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            seed=sampling.seed, stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty, min_p=sampling.min_p, min_tokens=sampling.min_tokens,
            logit_bias=tuple(sampling.logit_bias), bad_words_token_ids=bad_words,
            allowed_token_ids=None if sampling.allowed_token_ids is None else tuple(sampling.allowed_token_ids),
            logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs, n=sampling.n,
        )
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        param = _FIELD_OF.get(name, name) if name in _PARAMS else None
        raise APIError(f"Invalid value for '{param}': {e}" if param else str(e), param=param) from None
