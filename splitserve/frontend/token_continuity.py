"""Token continuity: a prompt that continues an earlier request's prompt + completion reuses its token ids.

Decode-side prefix reuse (and every prefix cache) matches by token ids. A multi-turn text chat re-renders the
whole history each turn, and a tokenizer whose tokens merge across spaces and newlines (SentencePiece-style BPE,
e.g. TinyStories') tokenizes it differently from the ids the model generated: the generation prompt's last token
``:`` merges with the answer's first space into ``:▁``, so turn 2 matched only up to that point. This module
remembers, per finished request, the text the model saw and produced (the prompt text + the completion text
exactly as returned) and its token ids (prompt ids + output ids, less a final EOS / stop token whose text was
not returned), in a bounded LRU (:class:`.text_prefix_index.TextPrefixIndex`). A new prompt text that starts
with a remembered text is encoded as those ids + the rest of the text encoded as a continuation.

Correctness: the ids used always decode to exactly the text a fresh encode of the prompt decodes to (checked on
every hit: ``decode(ids) == decode(encode(text))``, special tokens kept); only how the text is split into tokens
may differ. On any doubt (no hit, a continuation that does not encode cleanly, a decode mismatch) the prompt is
encoded fresh. The trade-off: the same text can tokenize differently on a warm front door than on a cold one,
so greedy output may differ from a fresh run's (the model sees its own tokens instead of a re-tokenization).

Encoding a continuation: the normalizer of SentencePiece-style tokenizers prepends ``▁`` to every encode call, so
the rest is encoded behind an anchor (:data:`ANCHOR`) whose own tokens are then dropped; the result is only used
when the anchor's tokens come out unchanged (and the whole id list passes the decode check).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

from splitserve.frontend.text_prefix_index import TextPrefixIndex

logger = logging.getLogger(__name__)

ANCHOR = "\n"
"""Text encoded in front of a continuation (and its tokens dropped): a newline is its own token in common
vocabularies and never merges with what follows."""

CONTEXT_TOKENS = 16
"""Prompt tokens decoded before the output to find the output's text in context."""

DEFAULT_MAX_MB = 64
"""Default memory bound of the remembered texts and ids, MiB."""


class TokenContinuity:
    """Remembered prompt + completion texts and their token ids (see the module docstring).

    Args:
        tokenizer: a :class:`.backend.TokenizerLike`.
        max_bytes: memory bound: each entry counts its text's UTF-8 bytes + 4 bytes per token id.

    Attributes:
        hits / misses / mismatches / stored: counters (``mismatches``: a remembered prefix whose continuation
            failed the decode check, the prompt was encoded fresh).
    """

    def __init__(self, tokenizer: Any, max_bytes: int = DEFAULT_MAX_MB * 2**20) -> None:
        self.tokenizer = tokenizer
        self.index: TextPrefixIndex[tuple[bool, array]] = TextPrefixIndex(max_bytes)
        self._anchor_ids = list(tokenizer.encode(ANCHOR, add_special_tokens=False))
        self.hits = self.misses = self.mismatches = self.stored = 0

    def stats(self) -> dict[str, float]:
        """Counters and sizes: hits, misses, mismatches, stored, entries, bytes, evictions."""
        return dict(hits=self.hits, misses=self.misses, mismatches=self.mismatches, stored=self.stored,
                    entries=len(self.index), bytes=self.index.nbytes, evictions=self.index.evictions)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of prompt ``text``: a remembered prefix's ids + the rest as a continuation, or a fresh
        encode (no hit, or any check failed). Either way they decode to what ``tokenizer.encode(text,
        add_special_tokens)`` decodes to. Raises what ``tokenizer.encode`` raises."""
        fresh = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        found = self.index.longest_prefix(text)
        if found is None or found[1][0] != add_special_tokens:
            self.misses += 1
            return fresh
        stored, (_, ids) = found
        rest = self.continuation(text[len(stored):])
        if rest is not None:
            candidate = [*ids, *rest]
            if candidate == fresh or self._decode(candidate) == self._decode(fresh):
                self.hits += 1
                return candidate
        self.mismatches += 1
        logger.debug("token continuity: a remembered prefix of %d chars did not verify; encoded fresh", len(stored))
        return fresh

    def continuation(self, rest: str) -> list[int] | None:
        """Token ids of ``rest`` as it continues earlier text (no BOS, no prepended ``▁``); None when the anchor
        does not encode cleanly in front of it."""
        if not rest:
            return []
        ids = list(self.tokenizer.encode(ANCHOR + rest, add_special_tokens=False))
        n = len(self._anchor_ids)
        if ids[:n] != self._anchor_ids:
            return None
        return ids[n:]

    def remember(self, prompt_text: str, add_special_tokens: bool, prompt_ids: Sequence[int],
                 output_ids: Sequence[int], completion_text: str) -> bool:
        """Remember that ``prompt_text`` (encoded with ``add_special_tokens``) as ``prompt_ids``, followed by the
        generated ``output_ids``, showed the client ``completion_text``. A head of ``output_ids`` whose text, in
        context, ``completion_text`` starts with is stored with that text: all of them when their text is the
        completion's, else all but the last (a final EOS or stop token), else the longest head a binary search finds
        (a stop string's tokens cut from the text, a special token generated mid-text with ``ignore_eos``).
        Returns whether anything was stored."""
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        base = self._decode(context)

        def piece(k: int) -> str | None:  # the text of output_ids[:k] if the completion starts with it
            full = self._decode([*context, *output_ids[:k]])
            text = full[len(base):] if full.startswith(base) else None
            return text if text is not None and completion_text.startswith(text) else None

        n = len(output_ids)
        k, text = n, piece(n)
        if text is None and n > 1:
            k, text = n - 1, piece(n - 1)
        if text is None:
            lo, hi, text = 0, n - 2, None  # the largest k in [1, n - 2] that passes
            while lo < hi:
                mid = (lo + hi + 1) // 2
                found = piece(mid)
                if found is None:
                    hi = mid - 1
                else:
                    lo, text = mid, found
            k = lo
        if not k or text is None:
            return False
        full_text = prompt_text + text
        ids = array("i", [*prompt_ids, *output_ids[:k]])
        if not self.index.put(full_text, (add_special_tokens, ids), len(full_text.encode("utf-8", "surrogatepass")) + 4 * len(ids)):
            return False
        self.stored += 1
        return True

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
