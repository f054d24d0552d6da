"""A bounded LRU of texts that finds, for a new text, the longest stored text that is a prefix of it.

The text analogue of the KV cache's chained block hashes: a text is cut into chunks of ``chunk_chars``
characters; chunk ``i``'s chain hash is ``hash((hash of chunk i-1, chunk i))`` (the hash of "no chunk yet" is a
fixed seed). An entry is filed under the chain hash of its last *whole* chunk (a text shorter than one chunk
under the seed), so the entries of one bucket all have ``len(text) // chunk_chars`` equal to the bucket's
depth. A lookup walks the new text's chain once (O(len)), then tries the buckets from the deepest down, the
longest entry of a bucket first, and confirms a candidate with ``new_text.startswith(entry_text)``: a hash
collision can cost a comparison, never a wrong answer.

Memory is bounded by ``max_bytes`` (each entry's size is given by the caller; least recently used entries are
evicted first) and by ``bucket_limit`` entries per bucket (many texts that share their whole chunks and
differ only in a short tail: the oldest of them is dropped). Thread-safe: one lock around every operation
(lookups run in the front door's worker threads).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

_SEED = hash(("splitserve.text_prefix_index", 0))


def chain_hashes(text: str, chunk_chars: int) -> Iterator[int]:
    """The chain hash after 0, 1, ... whole chunks of ``text`` (``len(text) // chunk_chars + 1`` values)."""
    h = _SEED
    yield h
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hash((h, text[start:start + chunk_chars]))
        yield h


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    nbytes: int
    bucket: int


class TextPrefixIndex(Generic[V]):
    """Text -> value, with :meth:`longest_prefix` lookups (see the module docstring).

    Args:
        max_bytes: bound on the sum of the entries' ``nbytes``; beyond it the least recently used go.
        chunk_chars: characters per hashed chunk.
        bucket_limit: most entries filed under one chain hash.

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_bytes: int, chunk_chars: int = 32, bucket_limit: int = 64) -> None:
        if max_bytes < 1 or chunk_chars < 1 or bucket_limit < 1:
            raise ValueError(f"TextPrefixIndex needs bounds >= 1, got max_bytes={max_bytes}, "
                             f"chunk_chars={chunk_chars}, bucket_limit={bucket_limit}")
        self.max_bytes = max_bytes
        self.chunk_chars = chunk_chars
        self.bucket_limit = bucket_limit
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[str, _Entry[V]] = OrderedDict()  # text -> entry, least recently used first
        self._buckets: dict[int, list[str]] = {}  # chain hash -> texts filed under it, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, text: str, value: V, nbytes: int) -> bool:
        """Store ``text`` -> ``value`` (replacing an entry of the same text) as the most recently used.
        Returns False, storing nothing, when ``nbytes`` alone exceeds ``max_bytes``."""
        if nbytes > self.max_bytes:
            return False
        *_, bucket = chain_hashes(text, self.chunk_chars)
        with self._lock:
            self._remove(text)
            texts = self._buckets.setdefault(bucket, [])
            texts.append(text)
            self._entries[text] = _Entry(value, nbytes, bucket)
            self.nbytes += nbytes
            if len(texts) > self.bucket_limit:
                self._remove(texts[0])
                self.evictions += 1
            while self.nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
        return True

    def longest_prefix(self, text: str) -> tuple[str, V] | None:
        """The longest stored text that ``text`` starts with (``text`` itself included) and its value, marked
        as the most recently used; None when no stored text is a prefix of ``text``."""
        hashes = list(chain_hashes(text, self.chunk_chars))
        with self._lock:
            for h in reversed(hashes):
                texts = self._buckets.get(h)
                if not texts:
                    continue
                for stored in sorted(texts, key=len, reverse=True):
                    if len(stored) <= len(text) and text.startswith(stored):
                        self._entries.move_to_end(stored)
                        return stored, self._entries[stored].value
        return None

    def _remove(self, text: str) -> None:
        entry = self._entries.pop(text, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        texts = self._buckets[entry.bucket]
        texts.remove(text)
        if not texts:
            del self._buckets[entry.bucket]
