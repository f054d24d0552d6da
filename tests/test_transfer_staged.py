"""The ``staged`` KV path end to end over real UCX on loopback (forced with staging="always", so it runs without a GPU):
pulls with partial blocks, a push, checksums, a corrupted send, mixed paths on the two sides, the path label on the
metrics and the span attribute; the same on the inproc backend; and the KV store's staged loads and saves."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from splitserve.errors import KVChecksumMismatch
from splitserve.telemetry.transfer import observe_receive
from splitserve.transfer import apply_ucx_env_defaults, create_receiver, create_sender
from splitserve.transfer.kv_cache import allocate_kv_cache
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.testing import block_bytes, expected_block, fill_pattern, transfer_pair
from tests.telemetry_helpers import Spans, sample

apply_ucx_env_defaults()

LAYOUT = KVLayout("test-model", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
B = LAYOUT.block_size
NUM_BLOCKS = 16
SALT = 5
ucx_loop = pytest.mark.asyncio(loop_scope="module")


def raw(t: torch.Tensor) -> torch.Tensor:  # bytes: the pattern holds bf16 NaNs, which never compare equal
    return t.contiguous().view(torch.uint8)


def assert_pulled(src, dst, src_ids, dst_ids, num_tokens: int, held: int = 0) -> None:
    """Moved rows equal the source's; a held first block's rows [0, held) and rows past the prompt stay 0."""
    for i, (s, d) in enumerate(zip(src_ids, dst_ids)):
        first, stop = (held if i == 0 else 0), min(B, num_tokens - i * B)
        if (first, stop) == (0, B):
            assert torch.equal(block_bytes(dst, d), expected_block(LAYOUT, s, SALT)), f"block {s} -> {d}"
            continue
        assert not bool(raw(dst[d, :, :, :first]).any())
        assert torch.equal(raw(dst[d, :, :, first:stop]), raw(src[s, :, :, first:stop]))
        assert not bool(raw(dst[d, :, :, stop:]).any())


@pytest.fixture
def spans(monkeypatch):
    return Spans(monkeypatch)


@ucx_loop
@pytest.mark.parametrize("kind", ["ucx", "inproc"])
@pytest.mark.parametrize("num_tokens,held", [(3 * B, 0), (2 * B + 5, 0), (3 * B + 7, 4)])
async def test_staged_pull_moves_the_same_bytes(kind, num_tokens, held, spans):
    src_ids, dst_ids = [9, 10, 11, 3][: -(-num_tokens // B)], [2, 3, 4, 12][: -(-num_tokens // B)]
    sent0 = sample("splitserve:kv_transfer_bytes_total", direction="send", transport=kind, path="staged")
    received0 = sample("splitserve:kv_transfer_bytes_total", direction="receive", transport=kind, path="staged")
    async with transfer_pair(kind, LAYOUT, NUM_BLOCKS, SALT, host="127.0.0.1", verify_checksum=True,
                             staging="always") as (sender, receiver, src, dst):
        assert sender.path == receiver.path == "staged"
        sender.register("t", src_ids, lambda tid, ok: None)
        with observe_receive(kind, sender.endpoint, "t", len(src_ids), path=receiver.path) as obs:
            obs.nbytes = await receiver.fetch(sender.endpoint, "t", src_ids, dst_ids, 10.0, num_tokens % B, held)
        for _ in range(100):  # the sender records its side once UCX reports the sends complete
            if sender.stats.transfers_ok:
                break
            await asyncio.sleep(0.01)
    assert_pulled(src, dst, src_ids, dst_ids, num_tokens, held)
    nbytes = (num_tokens - held) * (LAYOUT.block_nbytes // B)
    assert obs.nbytes == nbytes
    assert sample("splitserve:kv_transfer_bytes_total", direction="send", transport=kind, path="staged") == sent0 + nbytes
    assert sample("splitserve:kv_transfer_bytes_total", direction="receive", transport=kind, path="staged") == received0 + nbytes
    assert spans.named("kv.send").attributes["splitserve.kv.path"] == "staged"
    assert spans.named("kv.receive").attributes["splitserve.kv.path"] == "staged"


@ucx_loop
@pytest.mark.parametrize("kind", ["ucx", "inproc"])
async def test_staged_send_corrupted_in_flight_fails_the_checksum(kind):
    async with transfer_pair(kind, LAYOUT, 4, SALT, host="127.0.0.1", corrupt_sends=True, verify_checksum=True,
                             staging="always") as (sender, receiver, src, dst):
        sender.register("c", [1, 2], lambda tid, ok: None)
        with pytest.raises(KVChecksumMismatch):
            await receiver.fetch(sender.endpoint, "c", [1, 2], [0, 3], 10.0)
        assert torch.equal(block_bytes(src, 1), expected_block(LAYOUT, 1, SALT))  # the source pool was never touched


@ucx_loop
@pytest.mark.parametrize("sender_staging,receiver_staging", [("always", "never"), ("never", "always")])
async def test_each_side_picks_its_own_path(sender_staging, receiver_staging):
    """A staged side and an in-place side interoperate (as a cpu prefill worker feeds a cuda decode worker)."""
    src, dst = allocate_kv_cache(LAYOUT, 8), allocate_kv_cache(LAYOUT, 8)
    fill_pattern(src, SALT)
    sender = create_sender("ucx", src, LAYOUT, host="127.0.0.1", staging=sender_staging)
    receiver = create_receiver("ucx", dst, LAYOUT, verify_checksum=True, staging=receiver_staging)
    await sender.start()
    try:
        await receiver.start()
        try:
            assert (sender.path, receiver.path) == tuple("staged" if s == "always" else "host"
                                                         for s in (sender_staging, receiver_staging))
            sender.register("m", [1, 2, 5], lambda tid, ok: None)
            await receiver.fetch(sender.endpoint, "m", [1, 2, 5], [6, 7, 0], 10.0)
        finally:
            await receiver.close()
    finally:
        await sender.close()
    assert_pulled(src, dst, [1, 2, 5], [6, 7, 0], 3 * B)


@ucx_loop
@pytest.mark.parametrize("kind", ["ucx", "inproc"])
async def test_staged_push_layer_by_layer(kind, spans):
    async with transfer_pair(kind, LAYOUT, NUM_BLOCKS, SALT, host="127.0.0.1", verify_checksum=True,
                             staging="always") as (sender, receiver, src, dst):
        src_ids, dst_ids = [5, 2, 9], [0, 7, 3]
        task = asyncio.create_task(receiver.receive_push(sender.endpoint, "p", dst_ids, 2, 10.0))
        source = sender.open_push("p", 3)
        source.layers_done(src_ids, 2)
        assert await source.finish([11], src_ids, False, 10.0)
        result = await task
    assert result.first_token_ids == (11,) and result.nbytes == 3 * LAYOUT.block_nbytes
    assert_pulled(src, dst, src_ids, dst_ids, 3 * B)
    assert spans.named("kv.send").attributes["splitserve.kv.path"] == "staged"


@pytest.mark.parametrize("tail_rows", [0, 5])
async def test_kv_store_staged_save_and_load(tail_rows):
    """PD_KV_TRANSFER_STAGING=always: store saves copy the blocks out, loads copy them in once verified."""
    from splitserve.kvstore.kv_blocks import KVBlockStore
    from tests.memory_kvstore import MemoryStoreClient

    client = MemoryStoreClient()
    src, dst = allocate_kv_cache(LAYOUT, 8), allocate_kv_cache(LAYOUT, 8)
    fill_pattern(src, SALT)
    writer, reader = KVBlockStore(client, src, LAYOUT, staging="always"), KVBlockStore(client, dst, LAYOUT, staging="always")
    assert writer.path == reader.path == "staged"
    assert KVBlockStore(client, src, LAYOUT, staging="never").path == "host"
    with pytest.raises(ValueError, match="staging"):
        KVBlockStore(client, src, LAYOUT, staging="sometimes")
    keys = ["a", "b", "c"]
    assert (await writer.finish_save(keys, await writer.begin_save(keys, tail_rows), [1, 2, 3], tail_rows)).written == keys
    assert await reader.load(await reader.lookup_prefix(keys), [5, 6, 7], None, tail_rows) == 3
    assert_pulled(src, dst, [1, 2, 3], [5, 6, 7], 2 * B + (tail_rows or B))
    client.fail_reads = True  # a failed read lands nothing
    dst.zero_()
    assert await reader.load(await reader.lookup_prefix(keys), [5, 6, 7], None, tail_rows) == 0
    assert not bool(raw(dst).any())
