"""Whether a prompt text can possibly fit in the context: a check before tokenizing.

Every token stands for at most ``L`` characters of the normalized text, ``L`` being the longest
vocabulary entry (added tokens included). So a text whose normalized form keeps more than
``(max_model_len - 1) * L`` characters needs more than ``max_model_len - 1`` tokens and cannot fit
with even one completion token: it is refused with the same 400 as a prompt that was tokenized and
found too long, without spending seconds of CPU on it (about 9 s for 6 MB with the embedded
TinyStories tokenizer).

The check is exact (it never refuses a prompt that fits) because it is only made where the
tokenizer's own description (``tokenizer.json``) proves that characters cannot vanish:

* the model is BPE, and every character ends up in some token: byte-level BPE with all 256 byte
  characters in the vocabulary, byte fallback with all 256 byte tokens, or an unknown token that is not fused; then every input character counts
  (normalizers may shrink text by at most ``F`` = 4 for NFC/NFKC, where up to four code points
  compose into one, e.g. U+1FA4; ``F`` = 1 for the others allowed);
* or the model fuses runs of unknown characters into one token (TinyStories): then only characters
  the vocabulary knows count, and the normalizer may only prepend or replace single characters;
* normalizers never delete text (no ``Strip``, ``StripAccents``, BERT cleaning, regex ``Replace``);
  pre-tokenizers never remove what they split on (no ``Whitespace``, ``Split(..., "removed")``).

For anything else (WordPiece, Unigram, ...) there is no pre-check and prompts are only checked
after tokenization (which runs off the event loop either way).
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers.pre_tokenizers import ByteLevel

from splitserve.frontend.errors import APIError

_SHRINK = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1, "Replace": 1}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
_CHUNK = 1 << 16  # characters counted per str.translate call (the GIL is released between chunks)


class PromptLimit:
    """The pre-tokenization length check for one tokenizer and context length.

    Attributes:
        max_chars: texts of at most this many characters are never refused; None: no pre-check.
    """

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.max_chars: int | None = None
        self._count_all = True
        self._drop_known: dict[int, None] = {}
        spec = _spec(tokenizer.hf)
        if spec is None:
            return
        model, normalizer, pre = spec.get("model") or {}, spec.get("normalizer"), spec.get("pre_tokenizer")
        shrink = _normalizer_shrink(normalizer)
        if model.get("type") != "BPE" or shrink is None or not _pre_tokenizer_keeps_text(pre):
            return
        vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
        longest = max((len(token) for token in vocab), default=1)
        if _every_character_is_a_token(model, normalizer, pre, vocab):
            self.max_chars = max(max_model_len - 1, 0) * longest * shrink
        elif model.get("unk_token") and model.get("fuse_unk") and pre is None and shrink == 1:
            known = _known_input_characters(vocab, normalizer)
            if known is not None:
                self.max_chars = max(max_model_len - 1, 0) * longest
                self._count_all = False
                self._drop_known = {ord(c): None for c in known}

    def fits(self, text: str) -> bool:
        """False only when ``text`` certainly needs more than ``max_model_len - 1`` tokens."""
        if self.max_chars is None or len(text) <= self.max_chars:
            return True
        if self._count_all:
            return False
        unknown = sum(len(text[i : i + _CHUNK].translate(self._drop_known)) for i in range(0, len(text), _CHUNK))
        return len(text) - unknown <= self.max_chars

    def check(self, text: str, param: str) -> None:
        """Raise a 400 ``context_length_exceeded`` naming ``param`` unless ``text`` :meth:`fits`."""
        if not self.fits(text):
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt is "
                f"{len(text)} characters long, more than {self.max_model_len} tokens of this model can hold. "
                "Please reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )


def _spec(hf: Any) -> dict | None:
    try:
        return json.loads(hf.to_str())
    except Exception:  # a tokenizer that cannot describe itself: no pre-check
        return None


def _normalizer_shrink(node: dict | None) -> int | None:
    """How many input characters at most become one (None: the normalizer may delete text)."""
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1
        for child in node.get("normalizers", []):
            f = _normalizer_shrink(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = (node.get("pattern") or {}).get("String")
        if pattern is None or len(node.get("content") or "") < len(pattern):
            return None
    return _SHRINK.get(kind)


def _pre_tokenizer_keeps_text(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(child) for child in node.get("pretokenizers", []))
    return kind in _SAFE_PRE_TOKENIZERS and node.get("behavior") != "Removed"


def _every_character_is_a_token(model: dict, normalizer: dict | None, pre: dict | None, vocab: dict[str, int]) -> bool:
    if (_uses_byte_level(normalizer) or _uses_byte_level(pre)) and all(c in vocab for c in ByteLevel.alphabet()):
        return True
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    return bool(model.get("unk_token")) and not model.get("fuse_unk")


def _uses_byte_level(node: dict | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(child) for child in (node.get("normalizers") or node.get("pretokenizers") or []))


def _known_input_characters(vocab: dict[str, int], normalizer: dict | None) -> set[str] | None:
    """Input characters that normalize to a character of the vocabulary (never part of a fused unknown),
    when the normalizer maps characters one to one (Prepend, single-character Replace); else None."""
    known = {token for token in vocab if len(token) == 1}
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else [normalizer]
    mapped: dict[str, str] = {}  # input character -> what the steps so far made of it (absent: unchanged)
    for step in steps:
        if step is None or step.get("type") == "Prepend":
            continue
        pattern = (step.get("pattern") or {}).get("String") if step.get("type") == "Replace" else None
        content = step.get("content") or ""
        if pattern is None or len(pattern) != 1 or len(content) != 1:
            return None
        for src, now in mapped.items():
            if now == pattern:
                mapped[src] = content
        mapped.setdefault(pattern, content)
    return {c for c in known if c not in mapped} | {src for src, now in mapped.items() if now in known}
