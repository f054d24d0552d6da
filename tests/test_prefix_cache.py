"""The prefix-caching block manager and the scheduler's use of it (plain Python, no model)."""

import pytest

from splitserve.engine.prefix_cache import PrefixCachingBlockManager
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence
from splitserve.errors import CapacityExhausted

B = 4
ROOT = b"\x00" * 16


def keyed(bm, tokens):
    """Allocate blocks for ``tokens`` (whole blocks) and key them as computed; returns the block ids (in use)."""
    keys = bm.keys(tokens)
    ids = bm.allocate(len(keys))
    bm.cache(ids, keys)
    return ids


def test_freed_keyed_blocks_stay_cached_and_match_again():
    bm = PrefixCachingBlockManager(8, B, ROOT)
    ids = keyed(bm, list(range(12)))  # 3 full blocks
    bm.free(ids)
    assert bm.num_free == 8 and bm.num_cached == 3
    bm.check_integrity()
    # the same first 2 blocks, a different third: 2 hits, in order
    got = bm.match(bm.keys(list(range(8)) + [99, 98, 97, 96]))
    assert got == ids[:2] and bm.num_cached == 1
    bm.check_integrity()
    # a block in use can be matched again (one more reference)
    again = bm.match(bm.keys(list(range(4))))
    assert again == ids[:1]
    bm.free(again + got)
    assert bm.num_cached == 3 and bm.num_free == 8


def test_eviction_takes_free_blocks_first_then_least_recently_used_cached():
    bm = PrefixCachingBlockManager(6, B, ROOT)
    a = keyed(bm, [1] * 4)
    b = keyed(bm, [2] * 4)
    c = keyed(bm, [3] * 4)
    bm.free(b)
    bm.free(a)  # LRU order: b, then a
    assert bm.num_cached == 2 and len(bm._free) == 3
    new = bm.allocate(3)  # the free ones: nothing evicted
    assert bm.num_evicted == 0 and bm.num_cached == 2
    new += bm.allocate(1)  # evicts b (least recently used), keeps a
    assert bm.num_evicted == 1 and new[-1] == b[0]
    assert bm.match(bm.keys([2] * 4)) == [] and bm.match(bm.keys([1] * 4)) == a
    bm.free(a + c + new)
    bm.check_integrity()


def test_eviction_under_pressure_never_touches_blocks_in_use():
    bm = PrefixCachingBlockManager(10, B, ROOT)
    in_use = keyed(bm, list(range(16)))  # 4 keyed blocks held by a running request
    shared = bm.match(bm.keys(list(range(8))))  # and 2 of them shared by another
    spare = keyed(bm, list(range(100, 116)))
    bm.free(spare)  # 4 cached, 2 free
    taken = bm.allocate(6)  # every free and every cached block
    assert not set(taken) & set(in_use) and bm.num_cached == 0 and bm.num_evicted == 4
    with pytest.raises(CapacityExhausted):
        bm.allocate(1)
    assert bm.num_evicted == 4
    # the blocks in use kept their keys: a third request still finds all 4
    assert bm.match(bm.keys(list(range(16)))) == in_use
    bm.free(in_use + shared + in_use + taken)
    assert bm.num_cached == 4 and bm.num_free == 10
    bm.check_integrity()


def test_double_free_of_a_cached_block_raises():
    bm = PrefixCachingBlockManager(4, B, ROOT)
    ids = keyed(bm, [5] * 4)
    bm.free(ids)
    with pytest.raises(ValueError, match="double free"):
        bm.free(ids)
    with pytest.raises(ValueError, match="not in use"):
        bm.cache(ids, bm.keys([6] * 4))


def test_a_key_held_by_another_block_is_not_taken_twice():
    bm = PrefixCachingBlockManager(4, B, ROOT)
    a = keyed(bm, [7] * 4)
    b = keyed(bm, [7] * 4)  # the same tokens computed twice (two concurrent requests)
    bm.free(a + b)
    assert bm.num_cached == 1 and len(bm._free) == 3  # b was not keyed: it went back to the free list
    bm.check_integrity()


def sched(num_blocks=16):
    bm = PrefixCachingBlockManager(num_blocks, B, ROOT)
    return Scheduler(SchedulerConfig(block_size=B, max_model_len=64), bm, eos_token_ids=(0,)), bm


def run_prefill(s, seq):
    s.add(seq)
    batch, has_prefill = s.schedule()
    assert batch == [seq] and has_prefill
    return s.postprocess(batch, [1])


@pytest.mark.parametrize("n", [1, B - 1, B, B + 1, 3 * B + 5])
def test_scheduler_reuses_at_most_all_but_the_last_token(n):
    s, bm = sched()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = list(range(10, 10 + n))
    first = Sequence("a", prompt, params)
    assert run_prefill(s, first) == [first] and first.cached_tokens == 0
    assert bm.num_cached == n // B  # the prompt's full blocks (the first output token's KV is never computed)
    second = Sequence("b", prompt, params)
    run_prefill(s, second)
    want = (n - 1) // B * B  # whole blocks, and never the last token
    assert second.cached_tokens == want and second.cached_tokens < n
    assert s.prefix_cache.num_hit_blocks == want // B
    bm.check_integrity()
    assert bm.num_free == 16


def test_prompt_logprobs_requests_compute_every_position():
    s, bm = sched()
    prompt = list(range(3 * B))
    run_prefill(s, Sequence("a", prompt, SamplingParams(max_tokens=1)))
    seq = Sequence("b", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    run_prefill(s, seq)
    assert seq.cached_tokens == 0
