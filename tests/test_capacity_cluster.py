"""KV capacity on real processes: a router, a prefill worker with a 6-block KV pool and a decode worker with a
12-block pool (gRPC control, UCX data, KV store), plus a prefill worker outside the router (4 blocks, 3 s KV
lease, queue of 1) for the lease-timeout path.

A burst of concurrent requests far beyond the instantaneous capacity (KV held by leases until the decode
worker pulls it, by KV-store writes, by running requests) all complete with the colocated reference tokens,
none fails with a capacity error, and every pool is back to its baseline afterwards. Requests that could
never fit are refused at once with HTTP 400.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve.client import RouterClient
from splitserve.launcher import Child, build_cluster, free_port
from splitserve.model import load_model
from splitserve.paths import default_model_path
from tests.cluster import TEST_ENV
from tests.idle import wait_idle

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "TinyStories-656K"
MAX_TOKENS = 24
PREFILL_BLOCKS, DECODE_BLOCKS, LEASE_BLOCKS, LEASE_S = 6, 12, 4, 3.0
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she "
        "saw a big red ball in the park. She ran to get it, but a dog took it first.")


class Capacity:
    def __init__(self) -> None:
        self.cluster, http_port, grpc_port = build_cluster(
            model=str(default_model_path()), num_prefill=1, num_decode=1, http_port=0, grpc_port=0,
            worker_args=["--kv-cache-mb", "64"], env=dict(TEST_ENV), store_nodes=1, node_args=["--segment-mb", "32"])
        self.base_url, self.router = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        c = self.cluster.children
        self.p0, self.d0 = c[0], c[1]
        self.p0.argv += ["--num-blocks", str(PREFILL_BLOCKS)]
        self.d0.argv += ["--num-blocks", str(DECODE_BLOCKS)]
        port = free_port()
        argv = list(self.p0.argv)
        argv[argv.index("--port") + 1] = str(port)
        argv[argv.index("--metrics-port") + 1] = "0"
        argv += ["--num-blocks", str(LEASE_BLOCKS), "--kv-lease-s", str(LEASE_S), "--max-queue-len", "1"]
        self.lease = Child("prefill-lease", argv, f"grpc:127.0.0.1:{port}")
        self.cluster.children.append(self.lease)
        self.cluster.start()
        try:
            self.cluster.wait_healthy(timeout_s=120)
        except Exception:
            self.cluster.stop()
            raise

    @staticmethod
    def address(child: Child) -> str:
        return child.health.removeprefix("grpc:")

    async def stats(self, child: Child) -> dict[str, float]:
        stub_cls = decode_pb2_grpc.DecodeServiceStub if child is self.d0 else prefill_pb2_grpc.PrefillServiceStub
        async with grpc.aio.insecure_channel(self.address(child)) as ch:
            return dict((await stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=10)).counters)

    async def read_stats(self) -> tuple[dict[str, dict], None]:
        """GetStats counters of every worker by name (tests/idle.py); the router is not checked here."""
        return {w.name: await self.stats(w) for w in (self.p0, self.d0, self.lease)}, None

    async def wait_idle(self, timeout_s: float = 10.0) -> dict[str, dict]:
        """Every pool back to its baseline (tests/idle.py); returns each worker's counters then."""
        await wait_idle(self.read_stats, timeout_s)
        return (await self.read_stats())[0]


@pytest.fixture(scope="module")
def capacity():
    c = Capacity()
    yield c
    c.cluster.stop()


@pytest.fixture(autouse=True)
async def no_leaks(capacity):
    yield
    await capacity.wait_idle()


@pytest.fixture(scope="module")
def prompts():
    ids = load_model(default_model_path()).tokenizer.encode(TEXT * 2)
    assert len(ids) >= 40
    return [ids[: 5 + 5 * i] for i in range(8)]  # 5..40 tokens: 1 to 3 KV blocks on the prefill worker


async def tokens(address: str, prompt: list[int]) -> list[int]:
    async with RouterClient(address) as client:
        return [t async for r in client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                for t in r.token_ids]


async def http_text(base_url: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def test_a_burst_beyond_the_free_kv_blocks_completes_with_the_reference_tokens(capacity, colocated, prompts):
    ref = [await tokens(colocated.grpc_address, p) for p in prompts]
    ref_text = [await http_text(colocated.base_url, p) for p in prompts[:4]]
    before = {w.name: await capacity.stats(w) for w in (capacity.p0, capacity.d0)}
    async with RouterClient(capacity.router) as client:
        router_before = await client.stats()
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    async with grpc.aio.insecure_channel(capacity.address(capacity.p0)) as ch:
        prefill = prefill_pb2_grpc.PrefillServiceStub(ch)
        # KV of decode legs that have not come yet holds 5 of the prefill worker's 6 blocks when the burst arrives
        held = [await prefill.Prefill(prefill_pb2.PrefillRequest(request_id=f"held-{i}", prompt_token_ids=prompts[0],
                                                                 sampling=sampling), timeout=30) for i in range(5)]
        burst = [p for p in prompts for _ in range(2)]  # 16 requests; the repeats may reuse KV-store blocks
        run = asyncio.gather(
            asyncio.gather(*(tokens(capacity.router, p) for p in burst)),
            asyncio.gather(*(http_text(capacity.base_url, p) for p in prompts[:4])),
        )
        t0 = time.monotonic()
        while (await capacity.stats(capacity.p0))["requests_waiting"] < 1:  # the burst queues behind the held KV
            assert time.monotonic() - t0 < 30 and not run.done(), "the burst never waited for KV blocks"
            await asyncio.sleep(0.02)
        for h in held:  # then the held KV is released, as the router does when those decode legs fail
            assert (await prefill.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=h.kv_handle.transfer_id))).released
        got, got_text = await run
    assert got == [r for r in ref for _ in range(2)]
    assert got_text == ref_text
    report = await capacity.wait_idle()
    p, d = report["prefill-0"], report["decode-0"]
    assert p["kv_blocks_total"] == PREFILL_BLOCKS and d["kv_blocks_total"] == DECODE_BLOCKS
    # the burst did wait for blocks on the prefill worker (forced: the held KV), and nothing failed, timed out or fell
    # back (counted from before the burst: the other tests share these workers). Whether decode also waits (20
    # requests of up to 4 blocks for 12 blocks) depends on how many decode legs overlap, which the machine's speed
    # decides (and repeats share prompt blocks there): once in CI none waited, so it is not asserted
    assert p["kv_block_waits"] > before["prefill-0"]["kv_block_waits"]
    for s, name in ((p, "prefill-0"), (d, "decode-0")):
        for counter in ("queue_timeouts", "queue_refused"):
            assert s[counter] == before[name][counter], (name, counter)
    assert p["kv_leases_expired"] == before["prefill-0"]["kv_leases_expired"]
    assert d["kv_transfer_fallbacks"] == before["decode-0"]["kv_transfer_fallbacks"]
    async with RouterClient(capacity.router) as client:
        r = await client.stats()
    for counter in ("prefill_retries", "decode_retries", "local_prefill_fallbacks"):
        assert r.get(counter, 0) == router_before.get(counter, 0), counter


async def test_requests_that_can_never_fit_are_refused_at_once_with_400(capacity, prompts):
    tok = load_model(default_model_path()).tokenizer
    long_prompt = tok.encode(TEXT * 5)[: PREFILL_BLOCKS * 16 + 1]  # one token more than the prefill pool
    assert len(long_prompt) == PREFILL_BLOCKS * 16 + 1
    cases = [
        ({"prompt": long_prompt, "max_tokens": 2}, f"whole KV pool has {PREFILL_BLOCKS}"),
        ({"prompt": prompts[1], "max_tokens": DECODE_BLOCKS * 16}, f"whole KV pool has {DECODE_BLOCKS}"),
    ]
    async with httpx.AsyncClient(base_url=capacity.base_url, timeout=60) as http:
        for body, message in cases:
            t0 = time.monotonic()
            r = await http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and message in err["message"]
            assert time.monotonic() - t0 < 5
    assert await tokens(capacity.router, prompts[0])  # the next normal request succeeds


async def test_kv_held_for_a_decode_leg_that_never_comes_is_released_by_lease_timeout_then_the_waiter_runs(capacity, prompts):
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    before = await capacity.stats(capacity.lease)
    async with grpc.aio.insecure_channel(capacity.address(capacity.lease)) as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)

        def prefill(rid: str, prompt: list[int]):
            return stub.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling), timeout=30)

        warm = await prefill("warm-up", prompts[0])  # first call: store connection, first forward
        await stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=warm.kv_handle.transfer_id))
        # 1 block each (one at a time: the queue holds 1); no decode worker ever pulls them
        orphans = [await prefill(f"orphan-{i}", prompts[0]) for i in range(LEASE_BLOCKS)]
        assert all(o.HasField("kv_handle") for o in orphans)
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(prefill("waiter", prompts[1]))
        while (await capacity.stats(capacity.lease))["requests_waiting"] < 1:
            assert not waiter.done(), "the waiter did not wait for the leased blocks"
            await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the queue (max 1) is full: refused at once
            await prefill("one-too-many", prompts[2])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_len 1" in err.value.details()
        resp = await waiter  # runs once the orphans' leases expire
        waited = time.monotonic() - t0
        assert resp.HasField("kv_handle") and waited >= LEASE_S * 0.5
        assert resp.first_token_id == (await tokens(capacity.router, prompts[1]))[0]
        after = await capacity.stats(capacity.lease)
        assert after["kv_leases_expired"] - before["kv_leases_expired"] == LEASE_BLOCKS
        assert after["kv_block_waits"] > before["kv_block_waits"] and after["queue_refused"] == before["queue_refused"] + 1
        released = await stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=resp.kv_handle.transfer_id))
        assert released.released
