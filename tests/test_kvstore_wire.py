"""Store data-plane pieces without UCX: message encoding, range checks, merging of adjacent ranges."""

import numpy as np
import pytest

from splitserve.kvstore import wire
from splitserve.kvstore.data_client import merge_ranges


def test_request_and_status_round_trip_and_reject_garbage():
    req = wire.Request(wire.Op.WRITE, 77, [(0, 4096), (1 << 33, 16)])
    assert wire.decode_request(wire.encode_request(req)) == req
    assert wire.decode_status(wire.encode_status(wire.Status.INVALID, "x" * 2000)) == (wire.Status.INVALID, "x" * wire.MAX_DETAIL)
    for bad in [b"", b"SKO1" + bytes(20), wire.encode_request(req)[:-1], b"XXXX" + bytes(100)]:
        with pytest.raises(wire.WireError):
            wire.decode_request(bad)
    with pytest.raises(wire.WireError):
        wire.encode_request(wire.Request(wire.Op.READ, 1, []))
    assert wire.tag(5, 0) != wire.tag(5, 1) != wire.tag(6, 1)


def test_range_check():
    assert wire.check_ranges([(0, 10), (90, 10)], 100) == ""
    assert "outside" in wire.check_ranges([(95, 10)], 100)
    assert wire.check_ranges([(0, 0)], 100)


def test_adjacent_views_of_one_pool_merge_into_one_message():
    pool = np.arange(1000).astype(np.uint8)
    other = np.zeros(100, np.uint8)
    ranges = [(0, pool[0:100]), (100, pool[100:200]),  # adjacent on both sides: merged
              (300, pool[200:300]),  # a gap in the segment
              (400, pool[300:400]),
              (500, other),  # another buffer
              (600, pool[500:600])]  # not adjacent locally (pool[400:500] skipped)
    merged = merge_ranges(ranges)
    assert [(o, b.nbytes) for o, b in merged] == [(0, 200), (300, 200), (500, 100), (600, 100)]
    assert np.array_equal(merged[0][1], pool[0:200]) and np.shares_memory(merged[1][1], pool)
    assert merged[2][1] is other
