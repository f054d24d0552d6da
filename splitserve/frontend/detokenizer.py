"""Incremental detokenization: token ids in, text deltas out.

Primary implementation: ``tokenizers.decoders.DecodeStream`` primed with the tail of the
prompt (``DecodeStream(ids=context)``), so the first generated token keeps the leading
space it has in context (``"Once upon a"`` + ``"▁time"`` gives ``" time"``) and no prompt
text is re-emitted. It holds back tokens until they decode to complete UTF-8 (a partial
character is never emitted).

Fallback (when ``DecodeStream`` is unavailable or raises, e.g. ``InvalidPrefix``): the
prefix/read offset algorithm of Hugging Face TGI (``decode_token`` in
``server/text_generation_server/models/model.py``) and vLLM
(``detokenize_incrementally`` in ``vllm/transformers_utils/detokenizer_utils.py``):
decode ``ids[prefix:]`` and ``ids[prefix:read]`` and emit the difference when it does not
end in U+FFFD.

Special tokens (added tokens marked special, and the EOS ids) are dropped before decoding
instead of relying on ``skip_special_tokens``: some converted SentencePiece tokenizers
(e.g. TinyStories) store specials with a normalized form that ``skip_special_tokens``
fails to match.

Bytes of a character left incomplete when generation ends are never emitted (as in vLLM).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 6
"""Prompt tokens kept as decoding context (enough to settle spaces and merges)."""

_REPLACEMENT = "\ufffd"


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids never rendered as text: added tokens marked special, plus ``eos_token_ids``."""
    added = tokenizer.hf.get_added_tokens_decoder()
    ids = {i for i, tok in added.items() if tok.special}
    ids.update(int(i) for i in (getattr(tokenizer, "eos_token_ids", None) or ()))
    return frozenset(ids)


class OffsetDecoder:
    """The TGI/vLLM prefix/read offset incremental decoder (the fallback)."""

    def __init__(self, hf: Any, context: Sequence[int]) -> None:
        self._hf = hf
        self._ids = list(context)
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, token_id: int) -> str | None:
        """Add one token; return new text, or None while it is incomplete."""
        self._ids.append(token_id)
        prefix_text = self._hf.decode(self._ids[self._prefix : self._read], skip_special_tokens=False)
        new_text = self._hf.decode(self._ids[self._prefix :], skip_special_tokens=False)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None
        out = new_text[len(prefix_text) :]
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return out


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas.

    Args:
        tokenizer: a TokenizerLike (uses ``.hf`` and ``eos_token_ids``).
        prompt_ids: the prompt; its last :data:`CONTEXT_TOKENS` non-special ids are context.
        skip_special_tokens: drop special tokens (default, as OpenAI servers do).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True) -> None:
        self._hf = tokenizer.hf
        self._skip = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        context = [t for t in prompt_ids if t not in self._skip][-CONTEXT_TOKENS:]
        # _done: recent ids whose text has been emitted; _pending: ids fed but not yet emitted.
        self._done: list[int] = context
        self._pending: list[int] = []
        self._fallback: OffsetDecoder | None = None
        self._stream: Any = None
        try:
            self._stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        except Exception as e:  # old tokenizers without ids=, or a context it cannot decode
            log.info("DecodeStream unavailable (%s); using the offset decoder", e)
            self._fallback = OffsetDecoder(self._hf, context)

    @property
    def using_fallback(self) -> bool:
        """True once the offset-algorithm fallback is in use."""
        return self._fallback is not None

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" if none yet)."""
        if token_id in self._skip:
            return ""
        self._pending.append(token_id)
        if self._fallback is None:
            try:
                out = self._stream.step(self._hf, token_id)
            except Exception as e:
                log.warning("DecodeStream failed (%s); switching to the offset decoder", e)
                return self._switch_to_fallback()
        else:
            out = self._fallback.step(token_id)
        if out is None:
            return ""
        self._settle()
        return out

    def _settle(self) -> None:
        self._done = (self._done + self._pending)[-CONTEXT_TOKENS:]
        self._pending = []

    def _switch_to_fallback(self) -> str:
        self._stream = None
        self._fallback = OffsetDecoder(self._hf, self._done)
        pending, self._pending = self._pending, []
        text = []
        for t in pending:
            self._pending.append(t)
            out = self._fallback.step(t)
            if out is not None:
                text.append(out)
                self._settle()
        return "".join(text)
