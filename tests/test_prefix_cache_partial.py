"""Partial KV blocks in the prefix cache (a finished request's last, partly filled block): keyed by (parent hash,
token ids), matched by a prompt that continues with those tokens, evicted like full blocks, never while in use."""

import pytest

from splitserve.engine.prefix_cache import PrefixCachingBlockManager
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.errors import CapacityExhausted

B = 4
ROOT = b"\x00" * 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def finished(bm, tokens: list[int], computed: int) -> tuple[Sequence, list[int]]:
    """A request over ``tokens`` whose first ``computed`` tokens have KV, its blocks keyed as the scheduler does
    when it finishes; returns it and its block ids (freed: cached)."""
    seq = Sequence("r", tokens, PARAMS)
    seq.block_table = bm.allocate(-(-len(tokens) // B))
    seq.num_computed_tokens = computed
    bm.cache_computed(seq)
    bm.cache_partial(seq)
    ids = list(seq.block_table)
    bm.free(ids)
    return seq, ids


def manager(n=8) -> PrefixCachingBlockManager:
    bm = PrefixCachingBlockManager(n, B, ROOT)
    bm.keep_partial_blocks = True
    return bm


def test_partial_block_is_kept_and_matched_by_a_continuing_prompt():
    bm = manager()
    history = list(range(10, 17))  # 7 tokens: 1 full block + 3 rows
    _, ids = finished(bm, history + [99], computed=7)  # the last sampled token (99) has no KV
    assert bm.num_cached == 2
    parent = bm.keys(history)[0]
    assert bm.match_partial(parent, [14, 15]) is None  # shorter than the held rows
    assert bm.match_partial(parent, [14, 15, 7, 7]) is None  # diverges
    assert bm.match_partial(bm.root, [14, 15, 16, 1]) is None  # another parent
    assert bm.match_partial(parent, [14, 15, 16, 1]) == (ids[1], 3)  # the held rows then new tokens
    assert bm.num_cached == 1  # lent: in use until freed
    bm.free([ids[1]])
    assert bm.match_partial(parent, [14, 15, 16]) == (ids[1], 3)  # exactly the held rows
    bm.free([ids[1]])
    bm.check_integrity()


def test_longest_partial_block_wins_and_nothing_without_the_flag():
    bm = manager()
    _, a = finished(bm, [1, 2, 3], computed=2)  # rows (1, 2) after the root
    _, b = finished(bm, [1, 2, 3, 4], computed=3)  # rows (1, 2, 3)
    assert bm.match_partial(ROOT, [1, 2, 3, 9]) == (b[0], 3)
    bm.free([b[0]])
    off = PrefixCachingBlockManager(8, B, ROOT)
    finished(off, [1, 2, 3, 4], computed=3)
    assert off.num_cached == 0 and off.match_partial(ROOT, [1, 2, 3]) is None


def test_a_block_with_another_reference_is_not_keyed():
    bm = manager()
    seq = Sequence("r", [1, 2, 3], PARAMS)
    seq.block_table = bm.allocate(1)
    seq.num_computed_tokens = 2
    bm.incref(seq.block_table)  # e.g. shared: someone may still write into it
    bm.cache_partial(seq)
    bm.free(seq.block_table + seq.block_table)
    assert bm.num_cached == 0
    bm.check_integrity()


def test_eviction_under_pressure_never_touches_blocks_in_use_with_partial_entries():
    bm = manager(10)
    running = Sequence("run", list(range(100, 110)), PARAMS)  # 3 blocks in use by a running request
    running.block_table = bm.allocate(3)
    running.num_computed_tokens = 9
    bm.cache_computed(running)
    _, old = finished(bm, list(range(20, 27)), computed=6)  # 1 full + 1 partial cached
    _, new = finished(bm, list(range(40, 43)), computed=2)  # 1 partial cached (most recently used)
    lent = bm.match_partial(ROOT, [40, 41, 5])  # lent to a copy in progress: in use
    assert lent == (new[0], 2)
    assert bm.num_cached == 2 and bm.num_free == 4 + 2
    taken = bm.allocate(6)  # every free block and both cached ones of `old`
    assert set(old) <= set(taken) and not set(taken) & set(running.block_table + [new[0]])
    assert bm.num_evicted == 2 and bm.match_partial(bm.keys(list(range(20, 24)))[0], [24, 25, 0]) is None
    with pytest.raises(CapacityExhausted):  # nothing in use is ever evicted
        bm.allocate(1)
    bm.check_integrity()
    bm.free([new[0]])  # the copy is done: the partial block is cached again, and evictable
    assert bm.allocate(1) == [new[0]] and bm.match_partial(ROOT, [40, 41]) is None
    bm.free(taken + [new[0]] + running.block_table)
    assert bm.num_free == 10
    bm.check_integrity()
