"""UCX KV transfer between real processes on loopback: the sender runs in a spawned child process
(``splitserve.transfer.testing.SenderProcess``), the receiver in the test process."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
import pytest_asyncio
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX may otherwise route 127.0.0.1 over eth0 too

from splitserve.errors import KVChecksumMismatch, KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.transfer import TransferRefused, apply_ucx_env_defaults, create_receiver, create_sender
from splitserve.transfer import ucx_env_defaults, wire
from splitserve.transfer.common import Status
from splitserve.transfer.kv_cache import allocate_kv_cache
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.testing import (
    SenderProcess,
    block_bytes,
    expected_block,
    fill_pattern,
)

apply_ucx_env_defaults()


def real_ucx(test):
    """Real UCX (marked slow): all such tests share one event loop, hence one UCX context and receiver."""
    return pytest.mark.slow(pytest.mark.asyncio(loop_scope="module")(test))


# 64 KiB per block: above UCX's 8 KiB rendezvous threshold, like real KV blocks; small enough to be fast.
LAYOUT = KVLayout("test-model", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
NUM_BLOCKS = 64
SALT = 1
PEER_ENV = {"UCX_NET_DEVICES": os.environ["UCX_NET_DEVICES"]}


def start_peer(salt: int = SALT) -> SenderProcess:
    peer = SenderProcess(LAYOUT, NUM_BLOCKS, salt=salt, env=PEER_ENV)
    peer.start()
    return peer


@pytest.fixture(scope="module")
def peer():
    p = start_peer()
    yield p
    p.resume()
    p.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def receiver():
    pool = allocate_kv_cache(LAYOUT, NUM_BLOCKS)
    r = create_receiver("ucx", pool, LAYOUT, cancel_grace_s=0.3)
    await r.start()
    yield r, pool
    t0 = time.monotonic()
    await r.close()
    assert time.monotonic() - t0 < 2.0


def assert_blocks(pool, src_ids, dst_ids, salt=SALT):
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(block_bytes(pool, d), expected_block(LAYOUT, s, salt)), f"block {s} -> {d} differs"


def zero_blocks(pool, ids):
    for d in ids:
        block_bytes(pool, d).zero_()


def assert_zero(pool, ids):
    for d in ids:
        assert not torch.any(block_bytes(pool, d)), f"block {d} was written"


async def wait_events(peer, *transfer_ids, timeout_s=5.0):
    """The sender's on_done events, once there is one for each of ``transfer_ids`` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = peer.events()
        if {t for t, _ok in events} >= set(transfer_ids) or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------------- no processes


def test_env_defaults():
    env = ucx_env_defaults()
    assert env["UCX_MM_ERROR_HANDLING"] == "y"
    assert env["UCX_WARN_UNUSED_ENV_VARS"] == "n"
    assert "UCX_NET_DEVICES" not in env and "UCX_TLS" not in env
    target = {"UCX_MM_ERROR_HANDLING": "n"}
    apply_ucx_env_defaults(target)
    assert target["UCX_MM_ERROR_HANDLING"] == "n"  # setdefault: explicit settings win
    assert target["UCX_WARN_UNUSED_ENV_VARS"] == "n"


def test_wire_status_with_checksum():
    buf = wire.encode_status(Status.OK, "", 0xDEADBEEF12345678)
    assert wire.decode_status_checksum(buf) == (Status.OK, "", 0xDEADBEEF12345678)
    assert wire.decode_status_checksum(wire.encode_status(Status.OK)) == (Status.OK, "", None)
    req = wire.FetchRequest(1 << 24, 4096, 9, "t", [(1, 2)], flags=wire.FLAG_CHECKSUM)
    assert wire.decode_fetch(wire.encode_fetch(req)).flags == wire.FLAG_CHECKSUM


def test_wire_roundtrip():
    req = wire.FetchRequest(0xA5 << 56 | 7 << 24, 65536, 123, "tid-é", [(5, 3), (12, 1)])
    assert wire.decode_fetch(wire.encode_fetch(req)) == req
    assert wire.decode_status(wire.encode_status(Status.NOT_FOUND, "gone")) == (Status.NOT_FOUND, "gone")
    buf = wire.encode_fetch(req)
    with pytest.raises(wire.WireError):
        wire.decode_fetch(buf[:-1])
    with pytest.raises(wire.WireError):
        wire.decode_fetch(b"XXXX" + bytes(buf[4:]))


# ------------------------------------------------------------------------------------------- real UCX


@real_ucx
async def test_fragmented_and_contiguous(peer, receiver):
    r, pool = receiver
    failed_before = peer.stats()["transfers_failed"]  # the peer is shared: other tests fail transfers on purpose
    src, dst = [5, 6, 7, 12, 30, 31, 2], [0, 1, 2, 3, 10, 11, 40]  # 4 segments
    peer.register("frag", src)
    n = await r.fetch(peer.endpoint, "frag", src, dst, 10.0)
    assert n == len(src) * LAYOUT.block_nbytes
    assert_blocks(pool, src, dst)
    contig = list(range(40, 56))
    peer.register("contig", contig)
    n = await r.fetch(peer.endpoint, "contig", contig, list(range(16, 32)), 10.0)
    assert n == 16 * LAYOUT.block_nbytes
    assert_blocks(pool, contig, list(range(16, 32)))
    events = await wait_events(peer, "frag", "contig")
    assert ("frag", True) in events and ("contig", True) in events
    stats = peer.stats()
    assert stats["bytes_sent"] >= (len(src) + 16) * LAYOUT.block_nbytes and stats["transfers_failed"] == failed_before


@real_ucx
async def test_concurrent_fetches_share_one_endpoint(peer):
    pool = allocate_kv_cache(LAYOUT, NUM_BLOCKS)  # a receiver of its own: no endpoint cached by other tests
    r = create_receiver("ucx", pool, LAYOUT)
    await r.start()
    try:
        jobs = []
        for i in range(8):
            src = [i * 4 + 3, i * 4 + 2, i * 4 + 1, i * 4]  # reversed order: 4 one-block segments
            dst = [63 - i * 4, 62 - i * 4, 61 - i * 4, 60 - i * 4]
            peer.register(f"c{i}", src)
            jobs.append((f"c{i}", src, dst))
        sizes = await asyncio.gather(*(r.fetch(peer.endpoint, tid, s, d, 10.0) for tid, s, d in jobs))
        assert sizes == [4 * LAYOUT.block_nbytes] * 8
        for _tid, s, d in jobs:
            assert_blocks(pool, s, d)
        assert list(r._endpoints.peers) == [peer.endpoint]  # one cached endpoint per peer
    finally:
        await r.close()


@real_ucx
async def test_unknown_transfer_is_not_found_fast(peer, receiver):
    r, pool = receiver
    zero_blocks(pool, [0, 1])
    t0 = time.monotonic()
    with pytest.raises(TransferNotFound):
        await r.fetch(peer.endpoint, "never-registered", [3, 4], [0, 1], 10.0)
    assert time.monotonic() - t0 < 1.0
    assert_zero(pool, [0, 1])


@real_ucx
async def test_on_done_then_second_fetch_not_found(peer, receiver):
    r, _pool = receiver
    peer.register("once", [9, 10])
    await r.fetch(peer.endpoint, "once", [9, 10], [0, 1], 10.0)
    events = await wait_events(peer, "once")
    assert [e for e in events if e[0] == "once"] == [("once", True)]
    with pytest.raises(TransferNotFound):
        await r.fetch(peer.endpoint, "once", [9, 10], [0, 1], 10.0)
    await asyncio.sleep(0.1)
    assert [e for e in peer.events() if e[0] == "once"] == [("once", True)]  # exactly once


@real_ucx
async def test_unregistered_block_is_refused(peer, receiver):
    r, pool = receiver
    zero_blocks(pool, [20, 21, 22])
    peer.register("partial", [1, 2, 3])
    with pytest.raises(TransferRefused):
        await r.fetch(peer.endpoint, "partial", [1, 2, 4], [20, 21, 22], 10.0)
    with pytest.raises(TransferRefused):
        await r.fetch(peer.endpoint, "partial", [0], [20], 10.0)
    assert_zero(pool, [20, 21, 22])  # refused: nothing written, not even partially
    assert not [e for e in peer.events() if e[0] == "partial"]
    await r.fetch(peer.endpoint, "partial", [1, 2, 3], [20, 21, 22], 10.0)  # registration intact
    assert_blocks(pool, [1, 2, 3], [20, 21, 22])


@real_ucx
async def test_unregister_then_fetch(peer, receiver):
    r, _pool = receiver
    peer.register("dropped", [5])
    assert peer.unregister("dropped") is True
    with pytest.raises(TransferNotFound):
        await r.fetch(peer.endpoint, "dropped", [5], [0], 10.0)


@real_ucx
async def test_layout_mismatch(peer, receiver):
    other = KVLayout("other-model", 4, 4, 64, 16, "bfloat16")
    r2 = create_receiver("ucx", allocate_kv_cache(other, 4), other)
    await r2.start()
    try:
        peer.register("mismatch", [1])
        with pytest.raises(KVLayoutMismatch):
            await r2.fetch(peer.endpoint, "mismatch", [1], [0], 10.0)
        assert peer.unregister("mismatch") is True  # still registered
    finally:
        await r2.close()


@real_ucx
async def test_dead_port_fails_within_timeout(receiver):
    r, _pool = receiver
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(KVTransferError):
        await r.fetch(f"127.0.0.1:{port}", "t", [0], [0], 1.5)
    assert time.monotonic() - t0 < 1.5 + 1.0


@real_ucx
async def test_stalled_sender_times_out_without_late_writes(peer, receiver):
    r, pool = receiver
    dst = [50, 51, 52, 53]
    zero_blocks(pool, dst)
    peer.register("stall", [20, 21, 22, 23])
    peer.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError):
            await r.fetch(peer.endpoint, "stall", [20, 21, 22, 23], dst, 1.0)
        assert time.monotonic() - t0 < 1.0 + 1.0
    finally:
        peer.resume()
    await asyncio.sleep(0.5)  # the sender now sees the stale request; nothing may land in our blocks
    assert_zero(pool, dst)
    # the transfer was claimed by the stale request or is still registered: either way it ends once
    if peer.unregister("stall") is False:
        events = await wait_events(peer, "stall")
        assert [e for e in events if e[0] == "stall"] in ([("stall", False)], [("stall", True)])
    # the receiver reconnects
    peer.register("after-stall", [24])
    await r.fetch(peer.endpoint, "after-stall", [24], [50], 10.0)
    assert_blocks(pool, [24], [50])


@real_ucx
async def test_cancel_leaves_no_posted_receive(peer, receiver):
    r, pool = receiver
    dst = [40, 41, 42]
    zero_blocks(pool, dst)
    peer.register("cancel-me", [30, 31, 32])
    peer.pause()
    try:
        task = asyncio.ensure_future(r.fetch(peer.endpoint, "cancel-me", [30, 31, 32], dst, 10.0))
        await asyncio.sleep(0.3)
        assert not task.done()
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 0.3 + 1.5  # cancel_grace_s, then the endpoint is aborted
    finally:
        peer.resume()
    await asyncio.sleep(0.5)
    assert_zero(pool, dst)
    peer.register("after-cancel", [33])
    await r.fetch(peer.endpoint, "after-cancel", [33], [40], 10.0)
    assert_blocks(pool, [33], [40])


@real_ucx
async def test_connect_to_hung_peer_times_out_leaving_nothing_posted(receiver):
    """ucxx.create_endpoint left its handshake receive posted into a freed buffer when the peer was hung:
    the peer's late answer then corrupted the heap. Ours cancels it and waits for UCX before giving up."""
    from splitserve.transfer import ucx_connect

    r, pool = receiver
    victim = start_peer(salt=6)
    try:
        victim.pause()
        t0 = time.monotonic()
        with pytest.raises(KVTransferError):
            await r.fetch(victim.endpoint, "hung", [0], [0], 0.5)
        assert time.monotonic() - t0 < 0.5 + 2.5  # the handshake's deadline, then closing the endpoint
        assert not [o for o in ucx_connect._orphans if o[0] == victim.endpoint]  # closing cancelled it
        victim.resume()
        await asyncio.sleep(0.5)  # the peer now answers the abandoned handshake
        victim.register("after-hang", [4])
        await r.fetch(victim.endpoint, "after-hang", [4], [0], 10.0)
        assert_blocks(pool, [4], [0], salt=6)
    finally:
        victim.kill()


@real_ucx
async def test_peer_killed_mid_fetch(receiver):
    r, pool = receiver
    victim = start_peer(salt=5)
    try:
        victim.register("warm", [1])
        await r.fetch(victim.endpoint, "warm", [1], [0], 10.0)
        assert_blocks(pool, [1], [0], salt=5)
        victim.register("doomed", [2, 3])
        victim.pause()
        task = asyncio.ensure_future(r.fetch(victim.endpoint, "doomed", [2, 3], [1, 2], 20.0))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        victim.kill()
        with pytest.raises(KVTransferError):
            await task
        assert time.monotonic() - t0 < 10.0
        with pytest.raises(KVTransferError):  # gone for good: reconnect fails within the timeout
            await r.fetch(victim.endpoint, "doomed", [2], [1], 1.0)
    finally:
        victim.kill()


@real_ucx
async def test_sender_process_closes_quickly(receiver):
    r, _pool = receiver
    p = start_peer()
    p.register("t", [0])
    p.register("pending", [1])
    await r.fetch(p.endpoint, "t", [0], [0], 10.0)
    t0 = time.monotonic()
    events = p._call("close")
    p.proc.join(5)
    assert time.monotonic() - t0 < 3.0
    assert p.proc.exitcode == 0
    assert sorted(map(tuple, events)) == [("pending", False), ("t", True)]


@real_ucx
async def test_sender_in_same_process():
    """Sender and receiver on one UCX worker (shared tags); closing fails pending registrations."""
    src = allocate_kv_cache(LAYOUT, 8)
    src.view(-1).view(torch.uint8).fill_(7)
    sender = create_sender("ucx", src, LAYOUT, host="127.0.0.1")
    pool = allocate_kv_cache(LAYOUT, 8)
    r = create_receiver("ucx", pool, LAYOUT)
    await sender.start()
    await r.start()
    done = []
    try:
        sender.register("local", [3, 4], lambda t, ok: done.append((t, ok)))
        sender.register("left", [5], lambda t, ok: done.append((t, ok)))
        assert await r.fetch(sender.endpoint, "local", [3, 4], [0, 1], 10.0) == 2 * LAYOUT.block_nbytes
        assert bool((pool[0:2].view(-1).view(torch.uint8) == 7).all())
    finally:
        await r.close()
        t0 = time.monotonic()
        await sender.close()
        assert time.monotonic() - t0 < 2.0
    assert sorted(done) == [("left", False), ("local", True)]


@real_ucx
async def test_listener_survives_a_client_that_hangs_mid_handshake():
    """A client that connects but never completes the handshake (hung, or hostile) costs the listener one
    failed handshake after its timeout -- its receive is cancelled, not left posted -- and nothing else."""
    import ucxx._lib.libucxx as ucx_api
    from ucxx import core

    from splitserve.transfer import ucx_connect
    from splitserve.transfer.ucx_listener import UcxServer

    got = []
    server = UcxServer(lambda ep, msg: got.append(bytes(msg)) or True, name="test", handshake_timeout_s=0.3)
    await server.start()
    try:
        stalled = ucx_api.UCXEndpoint.create(core._get_ctx().worker, "127.0.0.1", server.port, True)
        t0 = time.monotonic()
        while server.handshakes_failed == 0:
            assert time.monotonic() - t0 < 3.0, "the listener never gave up on the stalled handshake"
            await asyncio.sleep(0.05)
        assert not [o for o in ucx_connect._orphans if o[0].startswith("client")]
        stalled.close_blocking(period=10**9, max_attempts=1)
        ep = await ucx_connect.create_endpoint("127.0.0.1", server.port, 5.0)  # others connect as usual
        await ep.am_send(b"hello")
        while not got:
            assert time.monotonic() - t0 < 5.0
            await asyncio.sleep(0.01)
        assert got == [b"hello"] and server.handshakes_failed == 1
        ep.abort()
    finally:
        t1 = time.monotonic()
        await server.close()
        assert time.monotonic() - t1 < 2.0


@real_ucx
async def test_many_small_segments_in_process():
    """2 KiB blocks (UCX eager path) and 512 one-block segments (more requests than ucxx's future pool)."""
    tiny = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
    src = allocate_kv_cache(tiny, 1024)
    fill_pattern(src, salt=2)
    dst = allocate_kv_cache(tiny, 1024)
    sender = create_sender("ucx", src, tiny)
    r = create_receiver("ucx", dst, tiny)
    await sender.start()
    await r.start()
    try:
        src_ids = list(range(0, 1024, 2))
        dst_ids = list(range(1023, 0, -2))
        sender.register("many", src_ids, lambda t, ok: None)
        assert await r.fetch(sender.endpoint, "many", src_ids, dst_ids, 20.0) == 512 * tiny.block_nbytes
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(block_bytes(dst, d), expected_block(tiny, s, 2))
    finally:
        await r.close()
        await sender.close()


@real_ucx
async def test_checksum_verified_transfer(peer):
    pool = allocate_kv_cache(LAYOUT, 8)
    r = create_receiver("ucx", pool, LAYOUT, verify_checksum=True)
    await r.start()
    try:
        peer.register("sum-ok", [3, 4, 9])
        assert await r.fetch(peer.endpoint, "sum-ok", [3, 4, 9], [0, 1, 5], 10.0) == 3 * LAYOUT.block_nbytes
        assert_blocks(pool, [3, 4, 9], [0, 1, 5])
        assert r.stats.checksum_failures == 0
    finally:
        await r.close()


@real_ucx
async def test_corrupted_transfer_is_detected(receiver):
    """A sender that corrupts every transfer after computing its checksum (fault injection): a verifying
    receiver raises KVChecksumMismatch; a non-verifying one silently gets the wrong bytes."""
    plain, pool = receiver
    bad = SenderProcess(LAYOUT, NUM_BLOCKS, salt=SALT, env=PEER_ENV, options={"corrupt_sends": True})
    bad.start()
    verifying = create_receiver("ucx", allocate_kv_cache(LAYOUT, 8), LAYOUT, verify_checksum=True)
    await verifying.start()
    try:
        bad.register("corrupt-1", [6, 7])
        with pytest.raises(KVChecksumMismatch, match="corrupted"):
            await verifying.fetch(bad.endpoint, "corrupt-1", [6, 7], [0, 1], 10.0)
        assert verifying.stats.checksum_failures == 1 and verifying.stats.transfers_failed == 1
        for attempt in range(2):  # the sender restores the flipped byte after each transfer
            tid = f"corrupt-plain-{attempt}"
            bad.register(tid, [6, 7])
            await plain.fetch(bad.endpoint, tid, [6, 7], [0, 1], 10.0)
            got, want = block_bytes(pool, 0), expected_block(LAYOUT, 6, SALT)
            assert int(got[0]) == int(want[0]) ^ 0xFF and torch.equal(got[1:], want[1:])
            assert_blocks(pool, [7], [1])
    finally:
        await verifying.close()
        bad.stop()
