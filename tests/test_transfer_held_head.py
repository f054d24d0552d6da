"""A pull into a partly held first KV block moves only its missing token rows (wire, inproc and real UCX)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from splitserve.errors import InvalidRequest, KVChecksumMismatch
from splitserve.transfer import apply_ucx_env_defaults, wire
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import segment_rows, split_head
from splitserve.transfer.testing import block_bytes, expected_block, transfer_pair

apply_ucx_env_defaults()

LAYOUT = KVLayout("test-model", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
B = LAYOUT.block_size
TOKEN = LAYOUT.block_nbytes // B
NUM_BLOCKS = 16
SALT = 7
MARK = 0x5A  # what the destination's held rows hold before the pull
# (tokens the pull covers from the first block on, rows of the first block already held)
CASES = [(B, 1), (B, B - 1), (B + 1, 15), (3 * B + 5, 4), (5, 3), (B - 1, B - 2), (2 * B, 8)]


def raw(t: torch.Tensor) -> torch.Tensor:  # bytes: the pattern holds bf16 NaNs, which never compare equal
    return t.contiguous().view(torch.uint8)


def check_blocks(src, dst, src_ids, dst_ids, num_tokens: int, held: int) -> None:
    """Block 0's rows [0, held) still hold MARK, the moved rows equal the source's, rows past the prompt are 0."""
    for i, (s, d) in enumerate(zip(src_ids, dst_ids)):
        first = held if i == 0 else 0
        stop = min(B, num_tokens - i * B)
        if (first, stop) == (0, B):
            assert torch.equal(block_bytes(dst, d), expected_block(LAYOUT, s, SALT))
            continue
        assert bool((raw(dst[d, :, :, :first]) == MARK).all())
        assert torch.equal(raw(dst[d, :, :, first:stop]), raw(src[s, :, :, first:stop]))
        assert not bool(raw(dst[d, :, :, stop:]).any())


def prepare(dst: torch.Tensor, dst_ids: list[int], held: int) -> None:
    dst.zero_()
    dst[dst_ids[0], :, :, :held].view(torch.uint8).fill_(MARK)


def test_segment_rows_and_split_head():
    assert split_head([(5, 0, 3)], 4) == [(5, 0, 1), (6, 1, 2)]
    assert split_head([(5, 0, 1), (9, 7, 2)], 4) == [(5, 0, 1), (9, 7, 2)]
    assert split_head([(5, 0, 3)], 0) == [(5, 0, 3)]
    assert segment_rows(0, 3, 4, 0, B) == (4, B)
    assert segment_rows(1, 3, 4, 5, B) is None
    assert segment_rows(2, 3, 4, 5, B) == (0, 5)
    assert segment_rows(0, 1, 4, 5, B) == (4, 5)
    assert segment_rows(0, 1, 0, 0, B) is None


def test_wire_carries_head_rows():
    req = wire.FetchRequest(7 << 24, LAYOUT.block_nbytes, 9, "t", [(1, 1), (4, 2), (8, 1)], "00-ab", 0, 3, 5)
    assert wire.decode_fetch(wire.encode_fetch(req)) == req
    one = wire.FetchRequest(7 << 24, LAYOUT.block_nbytes, 9, "t", [(1, 1)], tail_rows=9, head_rows=5)
    assert wire.decode_fetch(wire.encode_fetch(one)) == one
    plain = wire.FetchRequest(7 << 24, LAYOUT.block_nbytes, 9, "t", [(1, 3)])
    assert not wire.encode_fetch(plain)[6] & wire.FLAG_PARTIAL_HEAD  # the original format, byte for byte
    for bad in (wire.FetchRequest(7 << 24, 1, 9, "t", [(1, 3)], head_rows=3),  # not a run of its own
                wire.FetchRequest(7 << 24, 1, 9, "t", [(1, 1)], tail_rows=3, head_rows=3)):  # nothing left to move
        with pytest.raises(wire.WireError):
            wire.encode_fetch(bad)
    buf = wire.encode_fetch(req)
    with pytest.raises(wire.WireError):  # the head_rows field cut off
        wire.decode_fetch(buf[: -2 - len("00-ab") - 2])


@pytest.fixture
async def inproc_pair():
    async with transfer_pair("inproc", LAYOUT, NUM_BLOCKS, SALT, verify_checksum=True) as pair:
        yield pair


@pytest.mark.parametrize("num_tokens,held", CASES)
async def test_inproc_pull_moves_only_missing_rows(inproc_pair, num_tokens, held):
    sender, receiver, src, dst = inproc_pair
    nblocks = -(-num_tokens // B)
    src_ids, dst_ids = list(range(2, 2 + nblocks)), list(range(8, 8 + nblocks))
    prepare(dst, dst_ids, held)
    sender.register("t", src_ids, lambda t, ok: None)
    n = await receiver.fetch(sender.endpoint, "t", src_ids, dst_ids, 5.0, last_block_tokens=num_tokens % B,
                             first_block_held=held)
    assert n == (num_tokens - held) * TOKEN
    assert receiver.stats.bytes_received == sender.stats.bytes_sent == n
    check_blocks(src, dst, src_ids, dst_ids, num_tokens, held)
    assert receiver.stats.checksum_failures == 0


async def test_inproc_bad_held_rows_are_refused(inproc_pair):
    sender, receiver, _src, _dst = inproc_pair
    sender.register("t", [1], lambda t, ok: None)
    for held, last in ((B, 0), (-1, 0), (5, 5), (6, 5)):
        with pytest.raises(InvalidRequest):
            await receiver.fetch(sender.endpoint, "t", [1], [1], 5.0, last_block_tokens=last, first_block_held=held)


async def test_inproc_corrupted_held_block_is_detected():
    async with transfer_pair("inproc", LAYOUT, 4, SALT, corrupt_sends=True, verify_checksum=True) as (sender, receiver, src, dst):
        sender.register("bad", [2, 3], lambda t, ok: None)
        with pytest.raises(KVChecksumMismatch):
            await receiver.fetch(sender.endpoint, "bad", [2, 3], [0, 1], 5.0, first_block_held=3)
        assert receiver.stats.checksum_failures == 1


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("verify", [False, True])
async def test_ucx_pull_moves_only_missing_rows(verify):
    async with transfer_pair("ucx", LAYOUT, NUM_BLOCKS, SALT, host="127.0.0.1", verify_checksum=verify) as (sender, receiver, src, dst):
        for i, (num_tokens, held) in enumerate(CASES):
            nblocks = -(-num_tokens // B)
            src_ids, dst_ids = [9, 1, 2, 3][:nblocks], list(range(10, 10 + nblocks))
            prepare(dst, dst_ids, held)
            tid = f"h{i}"
            sender.register(tid, src_ids, lambda t, ok: None)
            sent = sender.stats.bytes_sent
            n = await receiver.fetch(sender.endpoint, tid, src_ids, dst_ids, 10.0, last_block_tokens=num_tokens % B,
                                     first_block_held=held)
            assert n == (num_tokens - held) * TOKEN, (num_tokens, held)
            check_blocks(src, dst, src_ids, dst_ids, num_tokens, held)
            for _ in range(200):  # the sender counts once UCX reports its sends complete
                if sender.stats.bytes_sent > sent:
                    break
                await asyncio.sleep(0.01)
            assert sender.stats.bytes_sent - sent == n
        assert receiver.stats.checksum_failures == 0


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_ucx_corrupted_held_block_is_detected():
    async with transfer_pair("ucx", LAYOUT, 4, SALT, host="127.0.0.1", corrupt_sends=True, verify_checksum=True) as (sender, receiver, src, dst):
        sender.register("bad", [2, 3], lambda t, ok: None)
        with pytest.raises(KVChecksumMismatch):
            await receiver.fetch(sender.endpoint, "bad", [2, 3], [0, 1], 10.0, first_block_held=3)
        assert receiver.stats.checksum_failures == 1
