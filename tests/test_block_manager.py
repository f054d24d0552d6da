import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.errors import CapacityExhausted


def test_allocate_prefers_a_consecutive_run():
    bm = BlockManager(10)
    a = bm.allocate(3)
    b = bm.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    bm.free([1])
    # a hole of one block is skipped for a request that needs a run of 3
    assert bm.allocate(3) == [5, 6, 7]
    assert bm.allocate(1) == [1]
    bm.check_integrity()


def test_fragmented_pool_still_allocates():
    bm = BlockManager(6)
    ids = bm.allocate(6)
    bm.free(ids[::2])  # 0, 2, 4 free
    assert bm.allocate(3) == [0, 2, 4]
    assert bm.num_free == 0


def test_refcounts_and_double_free():
    bm = BlockManager(4)
    ids = bm.allocate(2)
    bm.incref(ids)
    bm.free(ids)
    assert bm.num_free == 2
    bm.free(ids)
    assert bm.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        bm.free([ids[0]])
    bm.check_integrity()


def test_capacity_exhausted():
    bm = BlockManager(2)
    with pytest.raises(CapacityExhausted):
        bm.allocate(3)
    assert bm.num_free == 2
