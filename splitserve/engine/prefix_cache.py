"""Automatic prefix caching (as vLLM's): full KV blocks stay reusable after their request ends (plain Python, no torch).

A KV block whose ``block_size`` tokens all have K/V computed gets a key: the chained block hash of its tokens and
every token before it (:func:`splitserve.kvstore.block_hash.chain_hashes`, the KV store's scheme; the root is the
engine's KV layout namespace). Equal keys mean equal token prefixes, so the block's K/V is valid for any request
whose tokens start the same way.

Block states (``check_integrity`` verifies ``free + in use + cached == num_blocks``):

* free: in the free list, no key;
* in use: ref count >= 1, with or without a key (a key is set once the block is full and computed);
* cached: ref count 0 *with* a key -- evictable, kept in LRU order (least recently freed first).

A request that frees its last reference on a keyed block leaves it cached instead of free. ``match`` takes a
reference on the cached blocks of a prompt's longest keyed prefix (cached ones move back to in use). ``allocate``
takes free blocks first and evicts the least recently used cached blocks (dropping their keys) only when the free
list is short; blocks in use are never evicted. ``num_free`` counts free + cached blocks: both can be allocated.

Invariant relied on: the K/V of a keyed block never changes while it has its key. Only full, computed blocks get
keys; the engine never writes into a full computed block (it writes at positions >= ``num_computed_tokens``; a
prompt that is entirely cached still computes its last block: see :meth:`PrefixCachingBlockManager.reuse_prefix`).

Partial blocks (a multi-turn chat's history ends inside a block), with ``keep_partial_blocks`` (a decode worker sets
it: its delta transfer reuses them): when a request finishes, the block after its last
full one, holding ``r`` computed tokens (0 < r < block_size; the last sampled token has no KV), is keyed too, by
``(parent, tokens)``: the chained hash of the full blocks before it (the root for none) and the tuple of its ``r``
token ids. It is cached and evicted like a full block. Nobody writes into it again: no sequence owns it once its
request finished, and :meth:`PrefixCachingBlockManager.match_partial` only lends it to be copied (copy-on-write: the
taker copies rows ``[0, r)`` into a fresh block of its own and frees the reference).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Sequence as Seq

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sequence import Sequence
from splitserve.errors import CapacityExhausted
from splitserve.kvstore.block_hash import chain_hashes


class PrefixCachingBlockManager(BlockManager):
    """A :class:`BlockManager` that keeps finished requests' full blocks as a prefix cache (see the module docstring).

    Args:
        num_blocks: KV blocks in the pool.
        block_size: tokens per KV block.
        root: the 16-byte root hash of the KV layout namespace (``kvstore.block_hash.namespace_root``).

    ``keep_partial_blocks``: key finished requests' partial blocks too (off by default; see the module docstring).

    Counters: ``num_queried_blocks`` / ``num_hit_blocks`` (full prompt blocks looked up / found by ``match``),
    ``num_evicted`` (cached blocks reused for other tokens).
    """

    def __init__(self, num_blocks: int, block_size: int, root: bytes) -> None:
        super().__init__(num_blocks)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.root = root
        self._key_of: dict[int, bytes] = {}  # block id -> block hash (in use or cached)
        self._block_of: dict[bytes | tuple, int] = {}  # block hash, or (parent hash, tokens) of a partial block -> id
        self._partials: dict[bytes, set[tuple[int, ...]]] = {}  # parent hash -> token tuples of keyed partial blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref count 0, keyed: least recently used first
        self.keep_partial_blocks = False
        self.num_queried_blocks = 0
        self.num_hit_blocks = 0
        self.num_evicted = 0

    # --- the allocator, with cached blocks counted as allocatable ------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks held only by the cache (evictable)."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """As :meth:`BlockManager.allocate`, evicting least recently used cached blocks when fewer than ``n`` are
        free. Raises CapacityExhausted when free + cached blocks are fewer than ``n`` (nothing is evicted then)."""
        if n > self.num_free:
            raise CapacityExhausted(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        for _ in range(n - len(self._free)):
            block_id, _ = self._cached.popitem(last=False)
            self._drop_key(block_id)
            bisect.insort(self._free, block_id)
            self.num_evicted += 1
        return super().allocate(n)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a keyed block reaching 0 becomes cached (most recently used), any
        other returns to the free list. Raises ValueError on a double free."""
        for block_id in block_ids:
            if self._ref_counts.get(block_id) == 1 and block_id in self._key_of:
                del self._ref_counts[block_id]
                self._cached[block_id] = None
            else:
                super().free([block_id])

    def check_integrity(self) -> None:
        """Raise ValueError unless free, in-use and cached blocks partition the pool and every cached block is keyed."""
        used, cached = set(self._ref_counts), set(self._cached)
        free = set(self._free)
        if (len(free) + len(used) + len(cached) != self.num_blocks or used & cached or free & (used | cached)
                or not cached <= set(self._key_of) or len(self._key_of) != len(self._block_of)
                or sum(map(len, self._partials.values())) != sum(isinstance(k, tuple) for k in self._block_of)):
            raise ValueError("prefix-caching block manager integrity violated")

    def _drop_key(self, block_id: int) -> None:
        key = self._key_of.pop(block_id)
        del self._block_of[key]
        if isinstance(key, tuple):  # a partial block's
            tuples = self._partials[key[0]]
            tuples.discard(key[1])
            if not tuples:
                del self._partials[key[0]]

    # --- keys --------------------------------------------------------------------------------------------
    def cache(self, block_ids: Seq[int], keys: Seq[bytes]) -> None:
        """Key in-use blocks: ``block_ids[i]`` holds the K/V of the full block whose chained hash is ``keys[i]``.
        A block already keyed, or a key another block already holds, is left as it is."""
        for block_id, key in zip(block_ids, keys):
            if block_id not in self._ref_counts:
                raise ValueError(f"cannot cache KV block {block_id}: it is not in use")
            if block_id in self._key_of or key in self._block_of:
                continue
            self._key_of[block_id] = key
            self._block_of[key] = block_id

    def num_matching(self, keys: Seq[bytes]) -> int:
        """How many leading ``keys`` have a block (in use or cached), without taking anything."""
        n = 0
        for key in keys:
            if key not in self._block_of:
                break
            n += 1
        return n

    def match(self, keys: Seq[bytes]) -> list[int]:
        """Take one reference on the block of each leading key that has one (the longest cached prefix); returns
        those block ids, in order (the caller frees them)."""
        self.num_queried_blocks += len(keys)
        taken = []
        for key in keys[: self.num_matching(keys)]:
            block_id = self._block_of[key]
            self._take(block_id)
            taken.append(block_id)
        self.num_hit_blocks += len(taken)
        return taken

    def _take(self, block_id: int) -> None:
        """One more reference on a keyed block (a cached one moves back to in use)."""
        if block_id in self._cached:
            del self._cached[block_id]
            self._ref_counts[block_id] = 1
        else:
            self._ref_counts[block_id] += 1

    def match_partial(self, parent: bytes, token_ids: Seq[int]) -> tuple[int, int] | None:
        """The keyed partial block after the full blocks hashed ``parent`` whose tokens are the longest run that
        ``token_ids`` starts with; takes one reference on it (the caller copies its rows and frees it) and returns
        ``(block_id, r)``, ``r`` its tokens. None when no partial block matches."""
        best = max((t for t in self._partials.get(parent, ()) if tuple(token_ids[: len(t)]) == t), key=len, default=None)
        if best is None:
            return None
        block_id = self._block_of[(parent, best)]
        self._take(block_id)
        return block_id, len(best)

    def cache_partial(self, seq: Sequence) -> None:
        """Key a finishing ``seq``'s partial block (after its full computed blocks, see the module docstring): call
        before freeing its blocks. Nothing happens without ``keep_partial_blocks``, when it has none, or when
        another reference or a key is on it."""
        bs = self.block_size
        full, r = divmod(seq.num_computed_tokens, bs)
        if not self.keep_partial_blocks or not r or len(seq.block_table) <= full:
            return
        block_id = seq.block_table[full]
        if self._ref_counts.get(block_id) != 1 or block_id in self._key_of:
            return
        parent = self._seq_keys(seq, full)[-1] if full else self.root
        key = (parent, tuple(seq.token_ids[full * bs : full * bs + r]))
        if key in self._block_of:
            return
        self._key_of[block_id] = key
        self._block_of[key] = block_id
        self._partials.setdefault(parent, set()).add(key[1])

    def keys(self, token_ids: Seq[int]) -> list[bytes]:
        """Keys of the full blocks of ``token_ids``."""
        return chain_hashes(self.root, token_ids, self.block_size)

    # --- sequences (engine thread) -----------------------------------------------------------------------
    def _seq_keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Keys of ``seq``'s first ``num_blocks`` full blocks, extending ``seq.block_hashes`` incrementally."""
        have = seq.block_hashes
        if len(have) < num_blocks:
            bs = self.block_size
            parent = have[-1] if have else self.root
            have += chain_hashes(parent, seq.token_ids[len(have) * bs : num_blocks * bs], bs)
        return have[:num_blocks]

    def reuse_prefix(self, seq: Sequence) -> int:
        """Give a waiting ``seq`` without blocks the cached blocks of its longest cached prefix and mark those tokens
        computed; returns the tokens reused. At least the last token is left to compute (its logits give the next
        token), and never a block the step would write into: at most ``(num_tokens - 1) // block_size`` blocks."""
        if seq.block_table or seq.num_computed_tokens:
            return 0
        taken = self.match(self._seq_keys(seq, (seq.num_tokens - 1) // self.block_size))
        seq.block_table = taken
        seq.num_computed_tokens = len(taken) * self.block_size
        seq.num_keyed_blocks = len(taken)
        if not seq.output_token_ids:  # a first admission (a preempted request's reuse is not a prompt cache hit)
            seq.cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def cache_computed(self, seq: Sequence) -> None:
        """Key ``seq``'s blocks that became full and computed (call after each step that advanced it)."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_keyed_blocks:
            return
        keys = self._seq_keys(seq, full)
        self.cache(seq.block_table[seq.num_keyed_blocks : full], keys[seq.num_keyed_blocks :])
        seq.num_keyed_blocks = full
