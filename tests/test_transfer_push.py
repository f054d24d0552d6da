"""KV push (splitserve.transfer.push): pairing in either order, layer groups, completion, failure messages,
expiry, and a peer lost mid-push -- on the inproc backend (fast) and on real UCX (slow)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from splitserve.errors import KVChecksumMismatch, KVTransferError
from splitserve.transfer import apply_ucx_env_defaults, create_receiver, create_sender
from splitserve.transfer.kv_cache import allocate_kv_cache
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.push import group_bounds
from splitserve.transfer.testing import SenderProcess, block_bytes, expected_block, fill_pattern

apply_ucx_env_defaults()

LAYOUT = KVLayout("test-model", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
SALT = 3


def real_ucx(test):
    return pytest.mark.slow(pytest.mark.asyncio(loop_scope="module")(test))


async def pair(kind: str, verify: bool = False, wait_s: float = 10.0):
    src = allocate_kv_cache(LAYOUT, 16)
    fill_pattern(src, SALT)
    dst = allocate_kv_cache(LAYOUT, 16)
    sender = create_sender(kind, src, LAYOUT, push_wait_s=wait_s)
    receiver = create_receiver(kind, dst, LAYOUT, verify_checksum=verify)
    await sender.start()
    await receiver.start()
    return sender, receiver, src, dst


def layer_bytes(pool, block: int, layer: int) -> torch.Tensor:
    n = LAYOUT.block_nbytes // LAYOUT.num_layers
    return block_bytes(pool, block)[layer * n:(layer + 1) * n]


def assert_blocks(dst, src_ids, dst_ids):
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(block_bytes(dst, d), expected_block(LAYOUT, s, SALT)), f"block {s} -> {d}"


def test_group_bounds():
    assert group_bounds(4, 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert group_bounds(4, 1) == [(0, 4)]
    assert group_bounds(5, 2) == [(0, 2), (2, 5)]
    assert group_bounds(3, 9) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("subscribe_first", [True, False])
async def test_inproc_push_layer_by_layer(subscribe_first):
    sender, receiver, _src, dst = await pair("inproc")
    try:
        src_ids, dst_ids = [5, 2, 9], [0, 7, 3]
        if subscribe_first:
            task = asyncio.create_task(receiver.receive_push(sender.endpoint, "b1", dst_ids, 0, 5.0))
            await asyncio.sleep(0)
        source = sender.open_push("b1", 3)
        if not subscribe_first:
            task = asyncio.create_task(receiver.receive_push(sender.endpoint, "b1", dst_ids, 0, 5.0))
            await asyncio.sleep(0)
        source.layers_done(src_ids, 1)  # layer 0 lands before the prefill is done
        for _ in range(3):
            await asyncio.sleep(0)
        assert torch.equal(layer_bytes(dst, 7, 0), layer_bytes(_src, 2, 0))
        assert not bool(layer_bytes(dst, 7, 1).any())  # layer 1 not computed yet: not sent
        assert await source.finish([11, 12], src_ids, False, 5.0)
        result = await task
        assert result.first_token_ids == (11, 12) and not result.finished and result.nbytes == 3 * LAYOUT.block_nbytes
        assert_blocks(dst, src_ids, dst_ids)
        assert len(sender.push_table) == 0
    finally:
        await receiver.close()
        await sender.close()


async def test_inproc_failure_and_finished_messages():
    sender, receiver, _src, dst = await pair("inproc", wait_s=0.2)
    try:
        # prefill fails before decode subscribed: the late subscription fails at once (tombstone)
        await sender.open_push("f", 1).fail("invalid prompt")
        with pytest.raises(KVTransferError, match="invalid prompt"):
            await receiver.receive_push(sender.endpoint, "f", [0], 0, 5.0)
        # finished at prefill: no KV, the first tokens only
        task = asyncio.create_task(receiver.receive_push(sender.endpoint, "e", [1, 2], 0, 5.0))
        await asyncio.sleep(0)
        assert await sender.open_push("e", 2).finish([2], None, True, 5.0)
        assert (await task).finished
        # no prefill request ever comes: the subscription expires (wait_s) instead of waiting out its timeout
        with pytest.raises(KVTransferError, match="no prefill request"):
            await receiver.receive_push(sender.endpoint, "nobody", [0], 0, 5.0)
        # no subscription ever comes: finish reports False (the caller then leases the KV for a pull)
        assert not await sender.open_push("alone", 1).finish([1], [0], False, 5.0)
        # the block count must match
        task = asyncio.create_task(receiver.receive_push(sender.endpoint, "n", [0, 1], 0, 5.0))
        await asyncio.sleep(0)
        src = sender.open_push("n", 3)
        with pytest.raises(KVTransferError, match="3"):
            await task
        assert not await src.finish([1], [0, 1, 2], False, 0.5)
    finally:
        await receiver.close()
        await sender.close()


async def test_inproc_receiver_gone_fails_the_push():
    """The decode side stops waiting (its timeout, or it died): later sends fail and finish reports False."""
    sender, receiver, _src, _dst = await pair("inproc")
    try:
        source = sender.open_push("g", 1)
        with pytest.raises(KVTransferError, match="timed out"):
            await receiver.receive_push(sender.endpoint, "g", [0], 0, 0.05)
        assert not await source.finish([1], [4], False, 1.0)
    finally:
        await receiver.close()
        await sender.close()


@real_ucx
@pytest.mark.parametrize("groups", [0, 1, 3])
async def test_ucx_push_in_process(groups):
    sender, receiver, _src, dst = await pair("ucx", verify=True)
    try:
        src_ids, dst_ids = [1, 2, 3, 8], [9, 10, 4, 0]
        task = asyncio.create_task(receiver.receive_push(sender.endpoint, f"u{groups}", dst_ids, groups, 10.0))
        source = sender.open_push(f"u{groups}", 4)
        for n in range(1, LAYOUT.num_layers + 1):
            source.layers_done(src_ids, n)
            await asyncio.sleep(0.01)
        assert await source.finish([5], src_ids, False, 10.0)
        result = await task
        assert result.first_token_ids == (5,) and result.nbytes == 4 * LAYOUT.block_nbytes
        assert_blocks(dst, src_ids, dst_ids)
        await sender.open_push("x", 1).fail("engine aborted")
        with pytest.raises(KVTransferError, match="engine aborted"):
            await receiver.receive_push(sender.endpoint, "x", [5], groups, 10.0)
    finally:
        await receiver.close()
        await sender.close()


@real_ucx
async def test_ucx_corrupted_push_is_detected():
    sender, receiver, src, dst = await pair("ucx", verify=True)
    try:
        task = asyncio.create_task(receiver.receive_push(sender.endpoint, "c", [0], 0, 10.0))
        source = sender.open_push("c", 1)
        source.layers_done([2], LAYOUT.num_layers)
        while source._sub is None:  # connected and subscribed: the block is being sent
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        block_bytes(src, 2)[0] ^= 0xFF  # changed after it was sent: the completion's checksum differs
        await source.finish([1], [2], False, 10.0)
        with pytest.raises(KVChecksumMismatch):
            await task
    finally:
        await receiver.close()
        await sender.close()


@real_ucx
async def test_ucx_prefill_killed_mid_push():
    """The prefill worker's process dies after its first layer was pushed: the decode side fails fast (UCX
    endpoint error), far within its timeout, with no receive left posted."""
    peer = SenderProcess(LAYOUT, 16, salt=SALT, env={"UCX_NET_DEVICES": os.environ["UCX_NET_DEVICES"]})
    peer.start()
    dst = allocate_kv_cache(LAYOUT, 16)
    receiver = create_receiver("ucx", dst, LAYOUT, cancel_grace_s=0.3)
    await receiver.start()
    try:
        task = asyncio.create_task(receiver.receive_push(peer.endpoint, "k", [3, 4], 0, 30.0))
        await asyncio.to_thread(peer.push_open, "k", 2)
        await asyncio.to_thread(peer.push_layers, "k", [6, 7], 1)
        await asyncio.sleep(0.3)
        peer.kill()
        with pytest.raises(KVTransferError):
            await asyncio.wait_for(task, 20.0)  # fails (not times out) well before the push's own 30 s timeout
    finally:
        peer.kill()
        await receiver.close()


@real_ucx
async def test_ucx_decode_lost_mid_push():
    """The decode side's connection is gone mid-push: the prefill side's finish reports False (it then leases its
    still intact blocks for a pull) instead of hanging."""
    sender, receiver, _src, _dst = await pair("ucx")
    try:
        task = asyncio.create_task(receiver.receive_push(sender.endpoint, "d", [0, 1], 0, 30.0))
        source = sender.open_push("d", 2)
        source.layers_done([4, 5], 1)
        while source._sub is None:  # subscribed: layer 0 is on its way
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await receiver.close()  # aborts its endpoints: the posted receives are cancelled
        with pytest.raises((KVTransferError, asyncio.CancelledError)):
            await task
        assert not await asyncio.wait_for(source.finish([1], [4, 5], False, 5.0), 30.0)  # a hang fails here
    finally:
        await sender.close()
