"""SegmentAllocator: best fit, coalescing, integrity (plain ints)."""

import random

import pytest

from splitserve.services.kvstore.master.allocator import SegmentAllocator


def test_allocate_aligns_and_frees_back_to_one_range():
    a = SegmentAllocator(1024, alignment=64)
    offsets = [a.allocate(100) for _ in range(8)]  # 128 bytes each
    assert offsets == [i * 128 for i in range(8)]
    assert a.used_bytes == 1024 and a.allocate(1) is None
    for o in offsets[::2] + offsets[1::2]:
        a.free(o)
        a.check_integrity()
    assert a.used_bytes == 0 and a.allocate(1024) == 0


def test_best_fit_prefers_the_smallest_hole():
    a = SegmentAllocator(1000, alignment=1)
    _x, y, _z, w = a.allocate(100), a.allocate(300), a.allocate(50), a.allocate(200)
    a.free(y)  # hole of 300 at 100
    a.free(w)  # merges with the tail: hole of 550 at 450
    assert a.allocate(250) == y  # the 300 hole fits best
    assert a.allocate(400) == 450
    a.check_integrity()


def test_double_free_and_bad_sizes_raise():
    a = SegmentAllocator(256)
    o = a.allocate(10)
    a.free(o)
    with pytest.raises(ValueError):
        a.free(o)
    with pytest.raises(ValueError):
        a.allocate(0)
    with pytest.raises(ValueError):
        SegmentAllocator(0)


def test_random_workload_keeps_ranges_tiled_and_disjoint():
    rng = random.Random(7)
    a = SegmentAllocator(1 << 16, alignment=16)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.choice([16, 100, 1000, 4096])
            off = a.allocate(size)
            if off is None:
                assert a.free_bytes < a.aligned(size) or len(live) > 1  # only full or fragmented segments refuse
                continue
            end = off + a.aligned(size)
            assert all(end <= o or off >= o + n for o, n in live.items())  # no overlap with live ranges
            live[off] = a.aligned(size)
    a.check_integrity()
    assert a.used_bytes == sum(live.values())
