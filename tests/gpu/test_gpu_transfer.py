"""KV transfer between CUDA KV caches over real UCX (skipped without CUDA; nothing here has run on a GPU yet).

Run on a GPU machine with ``pytest -q -s tests/gpu/test_gpu_transfer.py``: ``-s`` shows UCX_TLS, the transports
of this process's UCX context, and (``UCX_PROTO_INFO=y``) the protocols UCX selected, e.g. ``rendezvous ...
cuda_copy`` or ``cuda_ipc``. Checks: a pull between two processes whose caches are on cuda takes the ``cuda`` path
with the same bytes; a host cache feeds a cuda cache; staging forced on cuda; a push; the KV store's staged path.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # network devices only; CUDA transports are not affected
os.environ.setdefault("UCX_PROTO_INFO", "y")  # UCX prints the protocol (and transport) it selects per message size

from splitserve.transfer import apply_ucx_env_defaults, create_receiver
from splitserve.transfer.kv_cache import allocate_kv_cache
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.testing import SenderProcess, block_bytes, expected_block, fill_pattern, transfer_pair

apply_ucx_env_defaults()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.asyncio(loop_scope="module")]

LAYOUT = KVLayout("test-model", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
B = LAYOUT.block_size
NUM_BLOCKS = 32
SALT = 9
PEER_ENV = {k: os.environ[k] for k in ("UCX_NET_DEVICES", "UCX_PROTO_INFO") if k in os.environ}
if "UCX_TLS" in os.environ:
    PEER_ENV["UCX_TLS"] = os.environ["UCX_TLS"]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def assert_pulled(dst: torch.Tensor, src_ids, dst_ids, num_tokens: int, salt: int = SALT) -> None:
    for i, (s, d) in enumerate(zip(src_ids, dst_ids)):
        stop = min(B, num_tokens - i * B)
        want = expected_block(LAYOUT, s, salt).view(LAYOUT.num_layers, 2, B, -1)
        got = raw(block_bytes(dst, d)).view(LAYOUT.num_layers, 2, B, -1)
        assert torch.equal(got[:, :, :stop], want[:, :, :stop]), f"block {s} -> {d}"
        assert not bool(got[:, :, stop:].any())


def report_transports(what: str) -> set[str]:
    from splitserve.transfer import ucx_runtime

    names = set(ucx_runtime.transports())
    print(f"\n[{what}] UCX_TLS={os.environ.get('UCX_TLS', '(unset: all)')} transports={sorted(names)} "
          f"device={torch.cuda.get_device_name()}")
    return names


async def pull_from_peer(peer_device: str, num_tokens: int) -> tuple[str, str]:
    """Pull ``num_tokens`` tokens' blocks from a sender process whose cache is on ``peer_device`` into a cuda cache;
    returns (the sender's path, the receiver's path)."""
    peer = SenderProcess(LAYOUT, NUM_BLOCKS, salt=SALT, env=PEER_ENV, device=peer_device)
    peer.start()
    dst = allocate_kv_cache(LAYOUT, NUM_BLOCKS, "cuda")
    receiver = create_receiver("ucx", dst, LAYOUT, verify_checksum=True)
    try:
        await receiver.start()
        report_transports(f"receiver, sender on {peer_device}")
        n = -(-num_tokens // B)
        src_ids, dst_ids = list(range(3, 3 + n)), list(range(20, 20 + n))
        peer.register("g", src_ids)
        await receiver.fetch(peer.endpoint, "g", src_ids, dst_ids, 30.0, num_tokens % B)
        assert_pulled(dst, src_ids, dst_ids, num_tokens)
        return peer.path(), receiver.path
    finally:
        await receiver.close()
        peer.stop()


@pytest.mark.process  # spawns a KV sender process
async def test_cuda_to_cuda_pull_takes_the_cuda_path():
    sender_path, receiver_path = await pull_from_peer("cuda", 5 * B + 3)
    print(f"sender path={sender_path} receiver path={receiver_path}")
    assert (sender_path, receiver_path) == ("cuda", "cuda")


@pytest.mark.process  # spawns a KV sender process
async def test_host_cache_feeds_a_cuda_cache():
    assert await pull_from_peer("cpu", 4 * B) == ("host", "cuda")


async def test_forced_staging_on_cuda():
    async with transfer_pair("ucx", LAYOUT, NUM_BLOCKS, SALT, host="127.0.0.1", verify_checksum=True, device="cuda",
                             staging="always") as (sender, receiver, _src, dst):
        assert sender.path == receiver.path == "staged"
        sender.register("s", [1, 2, 3], lambda tid, ok: None)
        await receiver.fetch(sender.endpoint, "s", [1, 2, 3], [7, 8, 9], 30.0, 6)
    assert_pulled(dst, [1, 2, 3], [7, 8, 9], 2 * B + 6)


@pytest.mark.parametrize("kind", ["ucx", "inproc"])
async def test_cuda_push_waits_for_the_layers(kind):
    async with transfer_pair(kind, LAYOUT, NUM_BLOCKS, SALT, host="127.0.0.1", verify_checksum=True,
                             device="cuda") as (sender, receiver, src, dst):
        assert sender.path == receiver.path == "cuda"
        if kind == "ucx":
            report_transports("in-process push")
        src_ids, dst_ids = [5, 2, 9], [0, 7, 3]
        task = asyncio.create_task(receiver.receive_push(sender.endpoint, "p", dst_ids, 2, 30.0))
        source = sender.open_push("p", 3)
        source.layers_done(src_ids, LAYOUT.num_layers)
        assert await source.finish([1], src_ids, False, 30.0)
        await task
    assert_pulled(dst, src_ids, dst_ids, 3 * B)


async def test_kv_store_stages_a_cuda_cache():
    from splitserve.kvstore.kv_blocks import KVBlockStore
    from tests.memory_kvstore import MemoryStoreClient

    client = MemoryStoreClient()
    src, dst = allocate_kv_cache(LAYOUT, 8, "cuda"), allocate_kv_cache(LAYOUT, 8, "cuda")
    fill_pattern(src, SALT)
    writer, reader = KVBlockStore(client, src, LAYOUT), KVBlockStore(client, dst, LAYOUT)
    assert writer.path == reader.path == "staged"
    keys = ["a", "b", "c"]
    assert (await writer.finish_save(keys, await writer.begin_save(keys, 5), [1, 2, 3], 5)).written == keys
    assert await reader.load(await reader.lookup_prefix(keys), [4, 5, 6], None, 5) == 3
    assert_pulled(dst, [1, 2, 3], [4, 5, 6], 2 * B + 5)
