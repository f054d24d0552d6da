"""A front door's :class:`.prepare.SamplingRequest` -> the engine's :class:`SamplingParams`.

Errors are :class:`.errors.APIError` 400s naming the request field (``param``) that holds the bad value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tokenizers import Tokenizer

from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.errors import APIError

_PARAMS = {f.name for f in fields(SamplingParams)}
_FIELD_OF = {"bad_words_token_ids": "bad_words"}  # SamplingParams field -> request field


def _without_prefix_space(spec: Any) -> tuple[Any, bool]:
    """A tokenizer.json ``normalizer`` or ``pre_tokenizer`` without what adds a prefix space to a text
    (SentencePiece's ``Prepend("▁")``, ``Metaspace``'s prepend scheme, ``ByteLevel``'s ``add_prefix_space``), and
    whether anything was taken out."""
    if not isinstance(spec, dict):
        return spec, False
    kind = spec.get("type")
    if kind == "Prepend":
        return None, True
    if kind == "Sequence":
        key = "normalizers" if "normalizers" in spec else "pretokenizers"
        parts = [_without_prefix_space(s) for s in spec.get(key) or []]
        return {**spec, key: [s for s, _ in parts if s is not None]}, any(c for _, c in parts)
    if kind == "Metaspace" and (spec.get("prepend_scheme", "always") != "never" or spec.get("add_prefix_space")):
        return {**spec, "prepend_scheme": "never", **({"add_prefix_space": False} if "add_prefix_space" in spec else {})}, True
    if kind == "ByteLevel" and spec.get("add_prefix_space"):
        return {**spec, "add_prefix_space": False}, True
    return spec, False


def bare_encoder(hf: Any) -> Any:
    """``hf`` (a ``tokenizers.Tokenizer``) without its prefix space: SentencePiece tokenizers prepend "▁" to every
    text they encode, so ``"{"`` encodes as ``"▁", "{"`` and its bare piece is never reached; the copy encodes it
    as the bare piece (``"<0x7B>"`` on a byte-fallback vocabulary). ``hf`` itself when it adds no prefix space."""
    spec = json.loads(hf.to_str())
    spec["normalizer"], normalizer_changed = _without_prefix_space(spec.get("normalizer"))
    spec["pre_tokenizer"], pre_changed = _without_prefix_space(spec.get("pre_tokenizer"))
    return Tokenizer.from_str(json.dumps(spec)) if normalizer_changed or pre_changed else hf


class BadWords:
    """vLLM's ``bad_words`` -> token-id sequences (``SamplingParams.update_from_tokenizer``), for one tokenizer.

    Each word (leading whitespace stripped) is encoded without special tokens and without the tokenizer's prefix
    space (:func:`bare_encoder`), and once more with a leading space; both are banned, so the word is banned
    where it follows a space and where it does not, SentencePiece tokenizers included. (vLLM keeps the spaced
    form only when it has as many tokens as the bare one; a SentencePiece vocabulary often splits the two
    differently, e.g. "d", "o", "g" and "▁do", "g", so the spaced form is kept whenever it differs.)

    Args:
        tokenizer: a :class:`.backend.TokenizerLike` (its ``hf`` encodes); the bare copy is made on first use.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._hf = tokenizer.hf
        self._bare: Any = None

    def __call__(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Token-id sequences to ban for ``words``.

        Raises:
            APIError: 400 ``bad_words`` for a word that encodes to no tokens.
        """
        if not words:
            return ()
        if self._bare is None:
            self._bare = bare_encoder(self._hf)
        out: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self._bare.encode(word.lstrip(), add_special_tokens=False).ids)
            if not plain:
                raise APIError(f"Invalid value for 'bad_words': {word!r} encodes to no tokens.", param="bad_words")
            out.append(plain)
            spaced = tuple(self._bare.encode(" " + word.lstrip(), add_special_tokens=False).ids)
            if spaced and spaced != plain:
                out.append(spaced)
        return tuple(out)


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences for ``bad_words`` (:class:`BadWords`; a front door keeps one per tokenizer instead).

    Raises:
        APIError: 400 ``bad_words`` for a word that encodes to no tokens.
    """
    return BadWords(tokenizer)(words)


MAX_TEMPERATURE = 2.0  # OpenAI's range, on both front doors (HTTP's schema, frontend/protocol.py, checks it first)


def build_params(sampling: Any, max_tokens: int, bad_words: tuple[tuple[int, ...], ...]) -> SamplingParams:
    """:class:`SamplingParams` from a :class:`.prepare.SamplingRequest` whose budget (``max_tokens``) and
    bad words (token ids) are resolved.

    Raises:
        APIError: 400 naming the field SamplingParams refused (e.g. ``min_tokens`` above ``max_tokens``).
    """
    temperature = sampling.options.get("temperature")
    if temperature is not None and temperature > MAX_TEMPERATURE:  # the engine takes up to 100; the API, OpenAI's 2
        raise APIError(f"Invalid value for 'temperature': must be in [0, {MAX_TEMPERATURE:g}], got {temperature!r}",
                       param="temperature")
    try:
        return SamplingParams(**sampling.options, max_tokens=max_tokens, bad_words_token_ids=bad_words)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        param = _FIELD_OF.get(name, name) if name in _PARAMS else None
        raise APIError(f"Invalid value for '{param}': {e}" if param else str(e), param=param) from None
