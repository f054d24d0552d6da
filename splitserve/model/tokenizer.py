"""Tokenizer wrapper around ``tokenizers.Tokenizer`` with the BOS/EOS rules serving needs."""

from __future__ import annotations

from typing import Any

import tokenizers


def token_content(tok: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, ``{"content": ...}`` or None."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class Tokenizer:
    """Text <-> token ids.

    ``encode`` never relies on the backend post-processor: it encodes without special tokens and
    prepends BOS itself iff ``add_bos_token`` (and the text does not already start with BOS).
    EOS is never added.

    Attributes:
        hf: the underlying ``tokenizers.Tokenizer``.
        bos_token / bos_token_id: BOS string and id, or None.
        eos_token: primary EOS string or None; eos_token_ids: all ids that end generation.
        add_bos_token: whether ``encode(..., add_special_tokens=True)`` prepends BOS.
        chat_template: Jinja chat template string or None.
        vocab_size: size including added tokens.
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        chat_template: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ):
        self.hf = hf
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        eos_id = hf.token_to_id(eos_token) if eos_token else None
        ids = ([eos_id] if eos_id is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.add_bos_token = bool(add_bos_token) and self.bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        special.update(i for i in (self.bos_token_id, *self.eos_token_ids) if i is not None)
        self._special = frozenset(special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS prepended iff ``add_special_tokens and add_bos_token`` and not already there.

        Releases the GIL while tokenizing (``encode_batch`` does, ``encode`` does not), so a long prompt
        tokenized in a worker thread does not stall the event loop. Raises TypeError for a str that is
        not valid Unicode (unpaired surrogates).
        """
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS/EOS/added special) dropped when ``skip_special_tokens``."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """True for BOS, EOS ids and added tokens marked special."""
        return int(token_id) in self._special

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos_ids={self.eos_token_ids}, "
                f"add_bos_token={self.add_bos_token})")


def backend_adds_bos(hf: tokenizers.Tokenizer, bos_token_id: int | None) -> bool:
    """Whether the tokenizer's own post-processor prepends BOS (used when tokenizer_config.json is silent)."""
    if bos_token_id is None:
        return False
    ids = hf.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_token_id
