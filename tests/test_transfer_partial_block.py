"""A pull moves only the used token rows of a partial last KV block (inproc and real UCX)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from splitserve.errors import InvalidRequest, KVChecksumMismatch
from splitserve.transfer import apply_ucx_env_defaults, wire
from splitserve.transfer.kv_cache import allocate_kv_cache, byte_view
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import PartialBlock, pack_rows, split_tail, unpack_rows
from splitserve.transfer.testing import block_bytes, expected_block, fill_pattern, transfer_pair

apply_ucx_env_defaults()

# 64 KiB per block (above UCX's rendezvous threshold), 4 KiB per token
LAYOUT = KVLayout("test-model", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
B = LAYOUT.block_size
TOKEN = LAYOUT.block_nbytes // B
NUM_BLOCKS = 16
SALT = 5


def cache_bytes(kv: torch.Tensor):
    return byte_view(kv).numpy()


def assert_rows(src: torch.Tensor, dst: torch.Tensor, s: int, d: int, rows: int) -> None:
    """Rows [0, rows) of block d equal block s's; rows [rows, B) of block d are still zero."""
    def raw(t: torch.Tensor) -> torch.Tensor:  # bytes: the pattern holds bf16 NaNs, which never compare equal
        return t.contiguous().view(torch.uint8)

    assert torch.equal(raw(dst[d, :, :, :rows]), raw(src[s, :, :, :rows]))
    assert not bool(raw(dst[d, :, :, rows:]).any())


def test_pack_rows_matches_the_cache_slice():
    kv = allocate_kv_cache(LAYOUT, 4)
    fill_pattern(kv, salt=SALT)
    geom = PartialBlock(LAYOUT)
    for rows in (1, 5, B - 1):
        packed = pack_rows(geom, cache_bytes(kv), 2, rows)
        assert packed.size == rows * TOKEN == geom.nbytes(rows)
        want = kv[2, :, :, :rows].contiguous().view(-1).view(torch.uint8).numpy()
        assert (packed == want).all()
        out = allocate_kv_cache(LAYOUT, 4)
        unpack_rows(geom, cache_bytes(out), 3, rows, packed)
        assert_rows(kv, out, 2, 3, rows)
        assert not bool(out[:3].any())
    with pytest.raises(ValueError):
        unpack_rows(geom, cache_bytes(kv), 0, 3, pack_rows(geom, cache_bytes(kv), 0, 2))
    for bad in (0, B, -1, 2.0):
        with pytest.raises(InvalidRequest):
            geom.check_rows(bad)


def test_split_tail_takes_the_last_block_out():
    assert split_tail([(5, 0, 3)], 4) == [(5, 0, 2), (7, 2, 1)]
    assert split_tail([(5, 0, 2), (9, 7, 1)], 4) == [(5, 0, 2), (9, 7, 1)]
    assert split_tail([(5, 0, 3)], 0) == [(5, 0, 3)]


def test_wire_carries_tail_rows():
    req = wire.FetchRequest(7 << 24, LAYOUT.block_nbytes, 9, "t", [(1, 2), (4, 1)], tail_rows=3)
    assert wire.decode_fetch(wire.encode_fetch(req)) == req
    whole = wire.FetchRequest(7 << 24, LAYOUT.block_nbytes, 9, "t", [(1, 3)])
    assert wire.decode_fetch(wire.encode_fetch(whole)).tail_rows == 0
    with pytest.raises(wire.WireError):  # the partial block must be a run of its own
        wire.encode_fetch(wire.FetchRequest(7 << 24, 1, 9, "t", [(1, 3)], tail_rows=3))
    buf = wire.encode_fetch(req)
    buf[38:40] = b"\x00\x00"  # FLAG_PARTIAL_TAIL with 0 rows
    with pytest.raises(wire.WireError):
        wire.decode_fetch(buf)


@pytest.fixture
async def inproc_pair():
    async with transfer_pair("inproc", LAYOUT, NUM_BLOCKS, SALT, verify_checksum=True) as pair:
        yield pair


@pytest.mark.parametrize("prompt_len", [1, B - 1, B, B + 1, 3 * B + 5])
async def test_inproc_pull_moves_only_used_rows(inproc_pair, prompt_len):
    sender, receiver, src, dst = inproc_pair
    nblocks = -(-prompt_len // B)
    src_ids, dst_ids = list(range(2, 2 + nblocks)), list(range(8, 8 + nblocks))
    sender.register("t", src_ids, lambda t, ok: None)
    n = await receiver.fetch(sender.endpoint, "t", src_ids, dst_ids, 5.0, last_block_tokens=prompt_len % B)
    assert n == prompt_len * TOKEN  # B + 1 tokens move (B + 1) tokens' bytes, not 2 blocks
    assert receiver.stats.bytes_received == sender.stats.bytes_sent == n
    for s, d in zip(src_ids[:-1], dst_ids[:-1]):
        assert torch.equal(block_bytes(dst, d), expected_block(LAYOUT, s, SALT))
    assert_rows(src, dst, src_ids[-1], dst_ids[-1], prompt_len - (nblocks - 1) * B)
    assert receiver.stats.checksum_failures == 0


async def test_inproc_bad_rows_are_refused(inproc_pair):
    sender, receiver, _src, _dst = inproc_pair
    sender.register("t", [1], lambda t, ok: None)
    with pytest.raises(InvalidRequest):
        await receiver.fetch(sender.endpoint, "t", [1], [1], 5.0, last_block_tokens=B + 1)


async def test_inproc_corrupted_partial_block_is_detected():
    async with transfer_pair("inproc", LAYOUT, 4, SALT, corrupt_sends=True, verify_checksum=True) as (sender, receiver, src, dst):
        sender.register("bad", [2], lambda t, ok: None)
        with pytest.raises(KVChecksumMismatch):
            await receiver.fetch(sender.endpoint, "bad", [2], [0], 5.0, last_block_tokens=3)
        assert receiver.stats.checksum_failures == 1


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("verify", [False, True])
async def test_ucx_pull_moves_only_used_rows(verify):
    async with transfer_pair("ucx", LAYOUT, NUM_BLOCKS, SALT, host="127.0.0.1", verify_checksum=verify) as (sender, receiver, src, dst):
        for i, prompt_len in enumerate((1, B - 1, B, B + 1, 3 * B + 5)):
            dst.zero_()
            nblocks = -(-prompt_len // B)
            src_ids, dst_ids = [9, 1, 2, 3][:nblocks], list(range(10, 10 + nblocks))  # 2 runs when > 1 block
            tid = f"p{i}"
            sender.register(tid, src_ids, lambda t, ok: None)
            sent = sender.stats.bytes_sent
            n = await receiver.fetch(sender.endpoint, tid, src_ids, dst_ids, 10.0, last_block_tokens=prompt_len % B)
            assert n == prompt_len * TOKEN, prompt_len
            for s, d in zip(src_ids[:-1], dst_ids[:-1]):
                assert torch.equal(block_bytes(dst, d), expected_block(LAYOUT, s, SALT))
            assert_rows(src, dst, src_ids[-1], dst_ids[-1], prompt_len - (nblocks - 1) * B)
            for _ in range(200):  # the sender counts once UCX reports its sends complete
                if sender.stats.bytes_sent > sent:
                    break
                await asyncio.sleep(0.01)
            assert sender.stats.bytes_sent - sent == n
        assert receiver.stats.checksum_failures == 0


@pytest.mark.parametrize("tail_rows", [0, 1, B - 1])
async def test_store_tail_object_holds_only_the_used_rows(tail_rows):
    """Store transfer mode: a partial last block is one object of tail_rows tokens' bytes, read back into its rows."""
    from splitserve.kvstore.kv_blocks import KVBlockStore
    from tests.memory_kvstore import MemoryStoreClient

    client = MemoryStoreClient()
    src = allocate_kv_cache(LAYOUT, 4)
    fill_pattern(src, salt=SALT)
    dst = allocate_kv_cache(LAYOUT, 8)
    writer, reader = KVBlockStore(client, src, LAYOUT), KVBlockStore(client, dst, LAYOUT)
    keys = ["full-a", "full-b", "tail"]
    tickets = await writer.begin_save(keys, tail_rows)
    report = await writer.finish_save(keys, tickets, [1, 2, 3], tail_rows)
    assert report.written == keys
    assert len(client.objects["tail"]) == (tail_rows or B) * TOKEN
    assert client.data.bytes_written == (2 * B + (tail_rows or B)) * TOKEN
    hits = await reader.lookup_prefix(keys)
    assert await reader.load(hits, [5, 6, 7], None, tail_rows) == 3
    assert client.data.bytes_read == client.data.bytes_written
    for s, d in ((1, 5), (2, 6)):
        assert torch.equal(block_bytes(dst, d), expected_block(LAYOUT, s, SALT))
    if tail_rows:
        assert_rows(src, dst, 3, 7, tail_rows)
    else:
        assert torch.equal(block_bytes(dst, 7), expected_block(LAYOUT, 3, SALT))
    client.fail_reads = True  # a failed tail read leaves its block untouched
    dst.zero_()
    assert await reader.load(hits[2:], [7], None, tail_rows) == 0
    assert not bool(block_bytes(dst, 7).any())
