"""KV transfer API semantics on the in-process backend (no UCX, no processes)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.errors import InvalidRequest, KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.transfer import TransferRefused, create_receiver, create_sender, supported_kinds
from splitserve.transfer.common import compute_segments
from splitserve.transfer.kv_cache import allocate_kv_cache
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.testing import block_bytes, expected_block, fill_pattern

LAYOUT = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
NUM_BLOCKS = 32


class Events:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, transfer_id: str, ok: bool) -> None:
        self.calls.append((transfer_id, ok))


@pytest.fixture
async def pair():
    src = allocate_kv_cache(LAYOUT, NUM_BLOCKS)
    fill_pattern(src, salt=3)
    dst = allocate_kv_cache(LAYOUT, NUM_BLOCKS)
    sender = create_sender("inproc", src, LAYOUT)
    receiver = create_receiver("inproc", dst, LAYOUT)
    await sender.start()
    await receiver.start()
    yield sender, receiver, dst
    await receiver.close()
    await sender.close()


def assert_blocks(dst, src_ids, dst_ids, salt=3):
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(block_bytes(dst, d), expected_block(LAYOUT, s, salt)), (s, d)


def test_segments_merge_runs_on_both_sides():
    assert compute_segments([5, 6, 7, 12], [0, 1, 2, 3], 16) == [(5, 0, 3), (12, 3, 1)]
    assert compute_segments([1, 2, 3], [4, 6, 7], 16) == [(1, 4, 1), (2, 6, 2)]
    assert compute_segments([], [], 16) == []
    with pytest.raises(InvalidRequest):
        compute_segments([1, 2], [3], 16)
    with pytest.raises(InvalidRequest):
        compute_segments([1], [16], 16)
    with pytest.raises(InvalidRequest):
        compute_segments([1, 2], [3, 3], 16)


def test_unknown_kind_lists_supported():
    with pytest.raises(ValueError, match="inproc, ucx"):
        create_sender("nccl", allocate_kv_cache(LAYOUT, 1), LAYOUT)
    assert supported_kinds() == ["inproc", "ucx"]


def test_cache_must_match_layout():
    with pytest.raises(ValueError):
        create_sender("inproc", torch.zeros(4, 2, 2, 4, 2, 8), LAYOUT)  # float32, layout says bfloat16


async def test_fragmented_and_contiguous(pair):
    sender, receiver, dst = pair
    done = Events()
    sender.register("frag", [5, 6, 7, 12, 20, 21], done)
    sender.register("contig", [8, 9, 10, 11], done)
    n = await receiver.fetch(sender.endpoint, "frag", [5, 6, 7, 12, 20, 21], [0, 1, 2, 3, 9, 4], 5.0)
    assert n == 6 * LAYOUT.block_nbytes
    assert_blocks(dst, [5, 6, 7, 12, 20, 21], [0, 1, 2, 3, 9, 4])
    n = await receiver.fetch(sender.endpoint, "contig", [8, 9, 10, 11], [12, 13, 14, 15], 5.0)
    assert n == 4 * LAYOUT.block_nbytes
    assert_blocks(dst, [8, 9, 10, 11], [12, 13, 14, 15])
    assert sorted(done.calls) == [("contig", True), ("frag", True)]
    assert receiver.stats.transfers_ok == 2 and receiver.stats.bytes_received == 10 * LAYOUT.block_nbytes
    assert sender.stats.bytes_sent == 10 * LAYOUT.block_nbytes


async def test_concurrent_fetches(pair):
    sender, receiver, dst = pair
    done = Events()
    for i in range(8):
        sender.register(f"t{i}", [2 * i, 2 * i + 1], done)
    sizes = await asyncio.gather(
        *(receiver.fetch(sender.endpoint, f"t{i}", [2 * i, 2 * i + 1], [31 - 2 * i, 30 - 2 * i], 5.0) for i in range(8))
    )
    assert sizes == [2 * LAYOUT.block_nbytes] * 8
    for i in range(8):
        assert_blocks(dst, [2 * i, 2 * i + 1], [31 - 2 * i, 30 - 2 * i])
    assert len(done.calls) == 8 and all(ok for _, ok in done.calls)


async def test_unknown_transfer_and_second_fetch(pair):
    sender, receiver, _dst = pair
    with pytest.raises(TransferNotFound):
        await receiver.fetch(sender.endpoint, "nope", [1], [1], 5.0)
    done = Events()
    sender.register("once", [1], done)
    await receiver.fetch(sender.endpoint, "once", [1], [1], 5.0)
    assert done.calls == [("once", True)]
    with pytest.raises(TransferNotFound):
        await receiver.fetch(sender.endpoint, "once", [1], [1], 5.0)
    assert done.calls == [("once", True)]  # exactly once


async def test_unregistered_block_is_refused(pair):
    sender, receiver, dst = pair
    done = Events()
    sender.register("t", [1, 2, 3], done)
    with pytest.raises(TransferRefused) as info:
        await receiver.fetch(sender.endpoint, "t", [1, 2, 4], [0, 1, 2], 5.0)
    assert isinstance(info.value, KVTransferError)
    assert not torch.any(block_bytes(dst, 0))  # nothing was copied
    assert done.calls == []
    await receiver.fetch(sender.endpoint, "t", [1, 2, 3], [0, 1, 2], 5.0)  # registration intact
    assert done.calls == [("t", True)]


async def test_unregister(pair):
    sender, receiver, _dst = pair
    done = Events()
    sender.register("t", [1], done)
    assert sender.unregister("t") is True
    assert sender.unregister("t") is False
    with pytest.raises(TransferNotFound):
        await receiver.fetch(sender.endpoint, "t", [1], [1], 5.0)
    assert done.calls == []


async def test_register_validation(pair):
    sender, _receiver, _dst = pair
    sender.register("t", [1], Events())
    with pytest.raises(ValueError):
        sender.register("t", [2], Events())
    with pytest.raises(ValueError):
        sender.register("u", [NUM_BLOCKS], Events())


async def test_unknown_endpoint_and_bad_arguments(pair):
    sender, receiver, _dst = pair
    with pytest.raises(KVTransferError):
        await receiver.fetch("127.0.0.1:1", "t", [1], [1], 1.0)
    with pytest.raises(InvalidRequest):
        await receiver.fetch(sender.endpoint, "t", [1, 2], [1], 1.0)
    with pytest.raises(InvalidRequest):
        await receiver.fetch("no-port", "t", [1], [1], 1.0)
    assert await receiver.fetch(sender.endpoint, "t", [], [], 1.0) == 0


async def test_layout_mismatch():
    other = KVLayout("other-model", 2, 2, 8, 4, "bfloat16")
    sender = create_sender("inproc", allocate_kv_cache(LAYOUT, 4), LAYOUT)
    receiver = create_receiver("inproc", allocate_kv_cache(other, 4), other)
    await sender.start()
    await receiver.start()
    sender.register("t", [1], Events())
    with pytest.raises(KVLayoutMismatch):
        await receiver.fetch(sender.endpoint, "t", [1], [1], 1.0)
    await sender.close()
    await receiver.close()


async def test_close_fails_pending_and_removes_endpoint():
    sender = create_sender("inproc", allocate_kv_cache(LAYOUT, 4), LAYOUT)
    receiver = create_receiver("inproc", allocate_kv_cache(LAYOUT, 4), LAYOUT)
    await sender.start()
    await receiver.start()
    done = Events()
    sender.register("t", [1], done)
    endpoint = sender.endpoint
    await sender.close()
    assert done.calls == [("t", False)]
    with pytest.raises(KVTransferError):
        await receiver.fetch(endpoint, "t", [1], [1], 1.0)
    await receiver.close()
