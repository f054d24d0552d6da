"""Chaos on real processes: a router, 2 prefill and 2 decode workers (gRPC over mutual TLS, API key, KV over
UCX with checksums) plus a prefill worker that corrupts every KV transfer it serves (fault injection, not
behind the router). Workers are killed (SIGKILL), stopped (SIGSTOP) and restarted with an unreachable KV
data endpoint; clients cancel, disconnect and let deadlines expire. Decode migration is off here
(``--decode-migrations 0``: a decode worker killed mid-stream ends its streams with UNAVAILABLE; on:
tests/test_migration_cluster.py). After every test, every live worker's KV pool is back to its baseline and no
stream is open anywhere; before every test, the router and its 4 workers are restored as they started
(tests/cluster.py ``restore``), so the tests run in any order.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import time

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc

from splitserve.client import RouterClient
from splitserve.launcher import Child, build_cluster, free_port
from splitserve.paths import default_model_path
from splitserve.rpc.server import channel
from splitserve.rpc.tls import TlsConfig
from tests.certs import make_pki, tls_env
from tests.cluster import TEST_ENV, restore, snapshot
from tests.idle import wait_idle

pytestmark = [pytest.mark.integration, pytest.mark.slow]

API_KEY = "chaos-test-key"
KV_TIMEOUT_S = 2.0
PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a big dog found a red ball in the park.",
    "Tom and Sue went to the beach with their mom.",
    "The cat was sad because it could not find its toy.",
]


class Chaos:
    def __init__(self, tmp) -> None:
        self.pki = make_pki(tmp)
        self.tls = TlsConfig(self.pki.cert, self.pki.key, self.pki.ca, client_auth=True)
        self._channels: dict = {}
        env = {**TEST_ENV, **tls_env(self.pki), "PD_API_KEY": API_KEY, "PD_KV_CHECKSUM": "1",
               "PD_KV_TRANSFER_TIMEOUT_S": str(KV_TIMEOUT_S),
               "PD_DECODE_MIGRATIONS": "0"}  # migration off: a decode worker's death mid-stream is an error (the old way)
        self.cluster, http_port, grpc_port = build_cluster(
            model=str(default_model_path()), num_prefill=2, num_decode=2, http_port=0, grpc_port=0,
            worker_args=["--kv-cache-mb", "32"], env=env)
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.router = f"127.0.0.1:{grpc_port}"
        c = self.cluster.children
        self.p0, self.p1, self.d0, self.d1, self.router_child = c
        self.argv = snapshot(self.cluster)
        port = free_port()
        argv = list(self.p0.argv)
        argv[argv.index("--port") + 1] = str(port)
        if "--metrics-port" in argv:  # a metrics port of its own (0: any free one)
            argv[argv.index("--metrics-port") + 1] = "0"
        self.corrupt = Child("prefill-corrupt", argv, f"grpc:127.0.0.1:{port}")
        self.cluster.start()
        self.cluster.start_child(self.corrupt, {"PD_KV_FAULTS": "corrupt"})
        try:
            self.cluster.wait_healthy(timeout_s=180, children=[*c, self.corrupt])
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        self.cluster.children.append(self.corrupt)
        self.cluster.stop()

    @staticmethod
    def address(child: Child) -> str:
        return child.health.removeprefix("grpc:")

    def client(self) -> RouterClient:
        return RouterClient(self.router, tls=self.tls, api_key=API_KEY)

    def http(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **kw)

    def _channel(self, address: str) -> grpc.aio.Channel:
        """One TLS channel per address and event loop (pytest-asyncio gives each test its own loop)."""
        key = (id(asyncio.get_running_loop()), address)
        if key not in self._channels:
            self._channels[key] = channel(address, self.tls)
        return self._channels[key]

    async def close_channels(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()

    async def stats(self, child: Child) -> dict[str, float]:
        stub_cls = decode_pb2_grpc.DecodeServiceStub if child.name.startswith("decode") else prefill_pb2_grpc.PrefillServiceStub
        ch = self._channel(self.address(child))
        return dict((await stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=10)).counters)

    def workers(self) -> list[Child]:
        return [w for w in (self.p0, self.p1, self.d0, self.d1, self.corrupt) if w.proc.poll() is None]

    async def read_stats(self) -> tuple[dict[str, dict], dict]:
        """GetStats counters of every live worker (by name) and of the router (tests/idle.py)."""
        workers = {w.name: await self.stats(w) for w in self.workers()}
        resp = await router_pb2_grpc.RouterServiceStub(self._channel(self.router)).GetStats(
            common_pb2.GetStatsRequest(), timeout=10, metadata=(("authorization", f"Bearer {API_KEY}"),))
        return workers, dict(resp.counters)

    async def wait_idle(self, timeout_s: float) -> float:
        return await wait_idle(self.read_stats, timeout_s)


@pytest.fixture(scope="module")
def shared_chaos(tmp_path_factory):
    c = Chaos(tmp_path_factory.mktemp("pki"))
    yield c
    c.stop()


@pytest.fixture
def chaos(shared_chaos):
    """The module's cluster with the router and every worker as started, up and in rotation (tests kill workers
    and restart prefill-0 with other flags)."""
    restore(shared_chaos.cluster, shared_chaos.argv)
    return shared_chaos


@pytest.fixture(autouse=True)
async def no_leaks(chaos):
    yield
    try:
        await chaos.wait_idle(timeout_s=3.0)  # every live worker's KV pool at baseline, no stream open anywhere
    finally:
        await chaos.close_channels()


async def greedy(chaos: Chaos, prompt, max_tokens=24, **kw) -> list[int]:
    ids = []
    async with chaos.client() as client:
        async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw):
            ids += r.token_ids
    return ids


async def decode_tokens(chaos: Chaos) -> float:
    return sum([(await chaos.stats(d))["decode_tokens"] for d in (chaos.d0, chaos.d1) if d.proc.poll() is None])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def reference_cache():
    return {}


@pytest.fixture
async def references(chaos, reference_cache):
    """Greedy tokens of PROMPTS, computed while the cluster is healthy (so any test can run alone)."""
    for p in PROMPTS:
        if p not in reference_cache:
            reference_cache[p] = await greedy(chaos, p)
    return reference_cache


# ------------------------------------------------------------------------------------------- security


async def test_tls_api_key_and_no_client_steering(chaos, references):
    # every gRPC server refuses plaintext and TLS clients without a certificate from our CA
    for child in (chaos.p0, chaos.d0, chaos.router_child):
        address = chaos.address(child) if child is not chaos.router_child else chaos.router
        for bad in (None, TlsConfig(ca_file=chaos.pki.ca), TlsConfig(chaos.pki.other_cert, chaos.pki.other_key, chaos.pki.ca)):
            async with (channel(address, bad) if bad else grpc.aio.insecure_channel(address)) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill_pb2_grpc.PrefillServiceStub(ch).GetStats(common_pb2.GetStatsRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # the front doors need the API key
    async with RouterClient(chaos.router, tls=chaos.tls) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate("Once", max_tokens=2):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with httpx.AsyncClient(base_url=chaos.base_url) as http:
        assert (await http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})).status_code == 401
    # no field or header lets a client name a worker, a KV endpoint or a store: nothing ever connects to the trap
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.5)
    target = f"127.0.0.1:{trap.getsockname()[1]}"
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    steering_fields = [
        {"kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": trap.getsockname()[1], "remote_block_ids": [0]}},
        {"prefill_address": target}, {"decode_address": target}, {"kv_endpoint": target}, {"endpoint": target},
        {"store_address": target}, {"bootstrap_host": "127.0.0.1", "bootstrap_port": trap.getsockname()[1]},
    ]
    headers = {"X-Prefill-Address": target, "X-Decode-Address": target, "X-KV-Endpoint": target,
               "X-Forwarded-Host": target, "Forwarded": f"for={target};host={target}"}
    async with chaos.http() as http:
        for extra in steering_fields:
            r = await http.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 400 and "Unrecognized request argument" in r.json()["error"]["message"], extra
        r = await http.post("/v1/completions", json=body, headers=headers)  # headers are not consulted
        assert r.status_code == 200
        chat = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi", "endpoint": target, "kv_transfer_params": {"host": target}}],
            "max_tokens": 4})
        assert chat.status_code == 200  # extra keys of a message only reach the chat template
    handle = common_pb2.KVHandle(transfer_id="x", endpoint=target, transport="ucx", block_ids=[0], num_tokens=1)
    request = router_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=common_pb2.SamplingParams(max_tokens=24, ignore_eos=True))
    raw = request.SerializeToString() + b"\x7a" + bytes([handle.ByteSize()]) + handle.SerializeToString()  # unknown field 15
    async with channel(chaos.router, chaos.tls) as ch:
        call = ch.unary_stream("/pd.v1.RouterService/Generate", response_deserializer=router_pb2.GenerateResponse.FromString)
        msgs = [m async for m in call(raw, metadata=(("authorization", f"Bearer {API_KEY}"), ("x-kv-endpoint", target),
                                                     ("x-prefill-address", target)))]
    assert [t for m in msgs for t in m.token_ids] == references[PROMPTS[0]]
    with pytest.raises(socket.timeout):
        trap.accept()
    trap.close()


# ------------------------------------------------------------------------------------------- cancellation, deadlines


async def test_cancel_and_disconnect_abort_every_service_within_1s(chaos):
    d_before = await decode_tokens(chaos)
    async with chaos.client() as client:  # gRPC: cancel after a few tokens
        stream = client.generate(PROMPTS[1], max_tokens=450, temperature=0.0, ignore_eos=True)
        for _ in range(3):
            await anext(stream)
        await stream.aclose()  # cancels the call
        t0 = time.monotonic()
    assert await chaos.wait_idle(timeout_s=1.0) < 1.0, time.monotonic() - t0
    async with chaos.http() as http:  # HTTP: the client disconnects mid-stream
        body = {"prompt": PROMPTS[2], "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
                if n == 3:
                    break
    assert await chaos.wait_idle(timeout_s=1.0) < 1.0
    d_after = await decode_tokens(chaos)
    assert d_after - d_before < 2 * 440  # both requests stopped early


async def test_expired_deadline_stops_the_work_everywhere(chaos):
    d_before = await decode_tokens(chaos)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await greedy(chaos, PROMPTS[3], max_tokens=480, timeout=0.25)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.0
    assert await chaos.wait_idle(timeout_s=1.0) < 1.0
    d_after = await decode_tokens(chaos)
    assert d_after - d_before < 470


async def test_dropped_client_stream_stops_the_work(chaos):
    async with chaos.client() as client:
        stream = client.generate(PROMPTS[0], max_tokens=450, temperature=0.0, ignore_eos=True)
        await anext(stream)
        await anext(stream)
        del stream  # neither closed nor cancelled
        gc.collect()
        assert await chaos.wait_idle(timeout_s=1.0) < 1.0


async def test_1000_streams_cancelled_after_the_first_token_leave_memory_flat(chaos, references):
    procs = {c.name: c.proc.pid for c in (chaos.p0, chaos.p1, chaos.d0, chaos.d1, chaos.router_child)}

    async def one(i: int, client: RouterClient, http: httpx.AsyncClient) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            stream = client.generate(prompt, max_tokens=64, temperature=0.0, ignore_eos=True)
            await anext(stream)
            await stream.aclose()
        else:
            body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break

    async def run(n: int) -> None:
        counter = iter(range(n))
        async with chaos.client() as client, chaos.http() as http:
            async def worker() -> None:
                for i in counter:
                    await one(i, client, http)
            await asyncio.gather(*(worker() for _ in range(16)))

    latencies: list[float] = []

    async def probe(stop: asyncio.Event) -> None:  # the server stays responsive under the churn
        async with chaos.http() as http:
            while not stop.is_set():
                t = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.monotonic() - t)
                await asyncio.sleep(0.25)

    await run(100)  # warm-up: caches, connection pools, allocator arenas
    await chaos.wait_idle(timeout_s=3.0)
    gc.collect()
    before = {name: rss_kib(pid) for name, pid in procs.items()}
    stop = asyncio.Event()
    prober = asyncio.ensure_future(probe(stop))
    t0 = time.monotonic()
    await run(1000)
    elapsed = time.monotonic() - t0
    stop.set()
    await prober
    await chaos.wait_idle(timeout_s=3.0)
    after = {name: rss_kib(pid) for name, pid in procs.items()}
    growth = {name: (after[name] - before[name]) / 1024 for name in procs}
    print(f"\n1000 cancelled streams in {elapsed:.1f} s ({1000 / elapsed:.0f}/s, concurrency 16); "
          f"/health p100 {max(latencies) * 1000:.0f} ms; RSS growth MiB: "
          + ", ".join(f"{k} {v:+.1f} (of {after[k] / 1024:.0f})" for k, v in growth.items()))
    assert all(g < 24 for g in growth.values()), growth  # flat: no per-request leak (1000 x 24 KiB would show)
    assert max(latencies) < 2.0
    assert await greedy(chaos, PROMPTS[0]) == references[PROMPTS[0]]


# ------------------------------------------------------------------------------------------- corrupted KV


async def test_corrupted_kv_is_detected_and_recomputed(chaos, references):
    prompt_ids = [1] + list(range(100, 140))  # 41 tokens: 3 blocks
    ref = await greedy(chaos, prompt_ids, max_tokens=16)
    d_before = await chaos.stats(chaos.d0)
    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    async with channel(chaos.address(chaos.corrupt), chaos.tls) as pch, channel(chaos.address(chaos.d0), chaos.tls) as dch:
        resp = await prefill_pb2_grpc.PrefillServiceStub(pch).Prefill(
            prefill_pb2.PrefillRequest(request_id="corrupt-1", prompt_token_ids=prompt_ids, sampling=sampling))
        msgs = [m async for m in decode_pb2_grpc.DecodeServiceStub(dch).Decode(decode_pb2.DecodeRequest(
            request_id="corrupt-1", prompt_token_ids=prompt_ids, sampling=sampling, kv_handle=resp.kv_handle,
            first_token_id=resp.first_token_id))]
    assert msgs[0].kv_recomputed
    assert [resp.first_token_id] + [t for m in msgs for t in m.token_ids] == ref
    d_after = await chaos.stats(chaos.d0)
    assert d_after["kv_checksum_failures"] == d_before["kv_checksum_failures"] + 1
    assert d_after["kv_transfer_fallbacks"] == d_before["kv_transfer_fallbacks"] + 1


# ------------------------------------------------------------------------------------------- worker death


async def test_prefill_killed_mid_prefill(chaos, references):
    async with chaos.client() as client:
        before = await client.stats()
    unaffected = asyncio.ensure_future(greedy(chaos, PROMPTS[0], max_tokens=300))  # already decoding
    await asyncio.sleep(0.3)
    os.kill(chaos.p0.proc.pid, signal.SIGSTOP)  # requests routed to it now hang inside its prefill...
    try:
        jobs = [asyncio.ensure_future(greedy(chaos, p)) for p in PROMPTS]
        await asyncio.sleep(1.0)
        assert sum(j.done() for j in jobs) <= 2  # ...the ones on prefill-1 may finish
        t0 = time.monotonic()
        os.kill(chaos.p0.proc.pid, signal.SIGKILL)  # ...and the worker dies mid-prefill
        results = await asyncio.wait_for(asyncio.gather(*jobs), timeout=10)
        recovered_s = time.monotonic() - t0
    finally:
        chaos.p0.proc.wait()
    assert results == [references[p] for p in PROMPTS]  # every affected request completed, retried elsewhere
    assert recovered_s < 3.0
    assert len(await unaffected) == 300  # untouched
    async with chaos.client() as client:
        after = await client.stats()
    assert after.get("prefill_retries", 0) - before.get("prefill_retries", 0) >= 2
    assert await greedy(chaos, PROMPTS[1]) == references[PROMPTS[1]]  # prefill-0 is dead: retried on prefill-1


async def test_unreachable_kv_data_endpoint_falls_back_within_the_timeout(chaos, references):
    """prefill-0 comes back advertising a KV data endpoint nobody listens on (its gRPC control path works)."""
    chaos.p0.proc.kill()  # stop the original prefill-0 first
    chaos.p0.proc.wait()
    dead = free_port()
    chaos.p0.argv = [*chaos.p0.argv, "--data-advertise", f"127.0.0.1:{dead}"]
    chaos.cluster.start_child(chaos.p0)
    chaos.cluster.wait_healthy(timeout_s=120, children=[chaos.p0])
    p0_address = Chaos.address(chaos.p0)
    async with chaos.http() as http:  # the router's channel may be in reconnect backoff (up to 5 s): wait for its poll
        deadline = time.monotonic() + 60
        while not any(w["address"] == p0_address and w["state"] == "up" for w in (await http.get("/v1/workers")).json()["workers"]):
            assert time.monotonic() < deadline, "the router never took the restarted prefill-0 back into rotation"
            await asyncio.sleep(0.2)
    served_by_p0 = 0
    for _ in range(6):  # until the router has sent prefill-0 requests
        t0 = time.monotonic()
        results = await asyncio.gather(*(greedy(chaos, p) for p in PROMPTS))
        assert results == [references[p] for p in PROMPTS]
        assert time.monotonic() - t0 < KV_TIMEOUT_S + 4.0  # a failed pull costs at most the transfer timeout
        served_by_p0 = (await chaos.stats(chaos.p0))["requests"]
        if served_by_p0 >= 2:
            break
        await asyncio.sleep(0.5)
    assert served_by_p0 >= 2
    fallbacks = sum([(await chaos.stats(d))["kv_transfer_fallbacks"] for d in (chaos.d0, chaos.d1)])
    assert fallbacks >= served_by_p0
    p0 = await chaos.stats(chaos.p0)
    assert p0["kv_leases_expired"] == 0  # its KV was released at once by the router, not by the lease


async def test_decode_killed_mid_stream(chaos, references):
    n_streams = 8
    running = [asyncio.Event() for _ in range(n_streams)]

    async def stream(i: int, client: RouterClient):
        n = 0
        try:
            async for r in client.generate(PROMPTS[i % len(PROMPTS)], max_tokens=450, temperature=0.0, ignore_eos=True):
                n += len(r.token_ids)
                if n >= 3:  # the first token comes from prefill, the next ones from a decode worker
                    running[i].set()
            return n, time.monotonic()
        except grpc.aio.AioRpcError as exc:
            running[i].set()
            return exc, time.monotonic()

    async with chaos.client() as client:
        tasks = [asyncio.ensure_future(stream(i, client)) for i in range(n_streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), timeout=30)
        t0 = time.monotonic()
        chaos.d1.proc.send_signal(signal.SIGKILL)  # every stream is mid-decode on decode-0 or decode-1
        chaos.d1.proc.wait()
        outcomes = await asyncio.gather(*tasks)
    errors = [(o, t - t0) for o, t in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert errors and all(e.code() == grpc.StatusCode.UNAVAILABLE and "decode worker" in e.details() for e, _ in errors)
    assert all(dt < 2.0 for _, dt in errors), errors  # a clear error at once, no hang
    assert all(o == 450 for o, _ in outcomes if not isinstance(o, grpc.aio.AioRpcError))  # the others are untouched
    assert len(errors) < len(outcomes)
    assert await greedy(chaos, PROMPTS[2]) == references[PROMPTS[2]]  # decode-1 is dead: retried on decode-0
    assert await greedy(chaos, PROMPTS[3]) == references[PROMPTS[3]]
