"""Hung workers and graceful shutdown on real processes: a router, 2 prefill and 2 decode workers with a 1 s gRPC
keepalive (a hung peer is detected within ~2 s) and engine steps slowed by 5 ms (streams surely in flight).

* a decode worker SIGSTOPped with streams in flight (decode migration off, ``--decode-migrations 0``; on:
  tests/test_migration_cluster.py): its streams end with UNAVAILABLE / an SSE error event within seconds, the
  others finish untouched, the router marks it down and routes around it, and after SIGCONT it is back in rotation;
* a prefill worker SIGSTOPped with requests routed to it: they are retried on the other one (the client sees
  nothing), and after SIGCONT it serves again;
* SIGTERM to a decode worker with streams in flight: NOT_SERVING at once, new work refused with UNAVAILABLE (the
  router sends it to the other worker), the in-flight streams complete with full, correct output, exit code 0;
* SIGTERM to the router: /health 503 and new requests refused at once, the streams in flight complete, exit 0.

After every test, every live worker's KV pool is back to its baseline and no stream is open anywhere; before
every test, the module's cluster is restored (tests/cluster.py ``restore``: the drained processes restarted), so the
tests run in any order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

from splitserve.client import RouterClient
from splitserve.launcher import Child
from splitserve.rpc.server import channel
from tests.cluster import restore, snapshot, start_cluster
from tests.idle import wait_idle, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEEPALIVE_S = 1.0  # PINGs every second, 1 s to answer: a hung peer is detected within ~2 s
DETECT_BOUND_S = 6.0  # what the tests allow for that (slack for a loaded 2-core machine)
LONG = 300  # tokens of a stream that is still running when the fault hits
STEP_DELAY_MS = 5  # every engine step takes this much longer (PD_FAULT_STEP_DELAY_MS): a LONG stream lasts > 1.5 s
PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a big dog found a red ball in the park.",
    "Tom and Sue went to the beach with their mom.",
    "The cat was sad because it could not find its toy.",
]


class Live:
    def __init__(self) -> None:
        env = {"PD_GRPC_KEEPALIVE_TIME_S": str(KEEPALIVE_S), "PD_GRPC_KEEPALIVE_TIMEOUT_S": str(KEEPALIVE_S),
               "PD_SHUTDOWN_GRACE_S": "60", "PD_FAULT_STEP_DELAY_MS": str(STEP_DELAY_MS),
               "PD_DECODE_MIGRATIONS": "0"}  # migration off: a hung decode worker's streams end with an error
        self.cluster, self.base_url, self.router = start_cluster(
            num_prefill=2, num_decode=2, store_nodes=0, worker_args=["--kv-cache-mb", "32"], env=env)
        self.p0, self.p1, self.d0, self.d1, self.router_child = self.cluster.children
        self.argv = snapshot(self.cluster)
        self._channels: dict = {}

    def stop(self) -> None:
        for c in self.cluster.children:  # never leave a stopped process behind
            if c.proc.poll() is None:
                os.kill(c.proc.pid, signal.SIGCONT)
        self.cluster.stop()

    @staticmethod
    def address(child: Child) -> str:
        return child.health.removeprefix("grpc:")

    def channel(self, address: str) -> grpc.aio.Channel:
        key = (id(asyncio.get_running_loop()), address)  # one per test (pytest-asyncio gives each test its loop)
        if key not in self._channels:
            self._channels[key] = channel(address)
        return self._channels[key]

    async def close_channels(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()

    async def stats(self, child: Child) -> dict[str, float]:
        stub = (decode_pb2_grpc.DecodeServiceStub if child.name.startswith("decode") else prefill_pb2_grpc.PrefillServiceStub)(
            self.channel(self.address(child)))
        return dict((await stub.GetStats(common_pb2.GetStatsRequest(), timeout=10)).counters)

    async def health(self, child: Child) -> int:
        ch = self.channel(self.address(child))
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status

    def workers(self) -> list[Child]:
        return [w for w in (self.p0, self.p1, self.d0, self.d1) if w.proc.poll() is None]

    async def worker_states(self) -> dict[str, str]:
        async with httpx.AsyncClient(base_url=self.base_url) as http:
            return {w["address"]: w["state"] for w in (await http.get("/v1/workers")).json()["workers"]}

    async def wait_state(self, child: Child, state: str, timeout_s: float) -> float:
        t0 = time.monotonic()
        while (await self.worker_states())[self.address(child)] != state:
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"{child.name} not {state} after {timeout_s} s")
            await asyncio.sleep(0.1)
        return time.monotonic() - t0

    async def read_stats(self) -> tuple[dict[str, dict], dict | None]:
        """GetStats counters of every live worker (by name) and of the router while it runs (tests/idle.py)."""
        workers = {w.name: await self.stats(w) for w in self.workers()}
        if self.router_child.proc.poll() is not None:
            return workers, None
        async with RouterClient(self.router) as client:
            return workers, await client.stats()

    async def wait_idle(self, timeout_s: float) -> float:
        return await wait_idle(self.read_stats, timeout_s)


@pytest.fixture(scope="module")
def shared_live():
    c = Live()
    yield c
    c.stop()


@pytest.fixture
def live(shared_live):
    """The module's cluster with every process running and every worker in rotation again (tests SIGTERM a
    decode worker and the router)."""
    restore(shared_live.cluster, shared_live.argv)
    return shared_live


@pytest.fixture(autouse=True)
async def no_leaks(live):
    yield
    try:
        await live.wait_idle(timeout_s=5.0)  # every live worker's KV pool at baseline, no stream open anywhere
    finally:
        await live.close_channels()


@pytest.fixture(scope="module")
def reference_cache():
    return {}


async def greedy(live: Live, prompt: str, max_tokens: int) -> list[int]:
    ids = []
    async with RouterClient(live.router) as client:
        async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            ids += r.token_ids
    return ids


@pytest.fixture
async def references(live, reference_cache):
    """Greedy tokens of PROMPTS (LONG of them), computed while every worker is healthy."""
    if not reference_cache:
        for p, ids in zip(PROMPTS, await asyncio.gather(*(greedy(live, p, LONG) for p in PROMPTS))):
            reference_cache[p] = ids
    return reference_cache


async def grpc_stream(live: Live, prompt: str) -> tuple[object, float]:
    """(token ids, or the AioRpcError that ended the stream; monotonic time it ended)."""
    ids: list[int] = []
    try:
        async with RouterClient(live.router) as client:
            async for r in client.generate(prompt, max_tokens=LONG, temperature=0.0, ignore_eos=True):
                ids += r.token_ids
        return ids, time.monotonic()
    except grpc.aio.AioRpcError as exc:
        return exc, time.monotonic()


async def sse_stream(live: Live, prompt: str) -> tuple[list[dict], float]:
    """The SSE events of a streamed completion (parsed JSON; "[DONE]" kept as a string)."""
    events: list = []
    body = {"prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events, time.monotonic()


async def decoding_on(live: Live, child: Child, n: int, timeout_s: float = 30.0) -> None:
    """Return as soon as ``n`` requests are decoding on ``child`` (early in their streams: a stream of LONG
    tokens then has most of its tokens still to come)."""
    t0 = time.monotonic()
    base = (await live.stats(child))["decode_tokens"]
    while True:
        s = await live.stats(child)
        if s["requests_running"] >= n and s["decode_tokens"] - base >= 2 * n:
            return
        assert time.monotonic() - t0 < timeout_s, f"{child.name}: not {n} requests decoding after {timeout_s} s: {s}"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------------------- hung workers


async def test_decode_worker_stopped_mid_stream(live, references):
    n_grpc, n_http = 6, 2
    tasks = [asyncio.ensure_future(grpc_stream(live, PROMPTS[i % 4])) for i in range(n_grpc)]
    tasks += [asyncio.ensure_future(sse_stream(live, PROMPTS[i % 4])) for i in range(n_http)]
    await decoding_on(live, live.d1, 3)  # streams mid-decode on decode-1 (and on decode-0)
    t0 = time.monotonic()
    os.kill(live.d1.proc.pid, signal.SIGSTOP)  # hung, not dead: its sockets stay open
    try:
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        grpc_out, http_out = outcomes[:n_grpc], outcomes[n_grpc:]
        errors = [(o, t - t0) for o, t in grpc_out if isinstance(o, grpc.aio.AioRpcError)]
        assert errors, "no stream was on decode-1"
        assert all(e.code() == grpc.StatusCode.UNAVAILABLE and f"decode worker {live.address(live.d1)}" in e.details()
                   for e, _ in errors), errors
        assert all(dt < DETECT_BOUND_S for _, dt in errors), errors  # detected by keepalive, not a hang
        for i, (o, _) in enumerate(grpc_out):  # streams on decode-0 are untouched
            if not isinstance(o, grpc.aio.AioRpcError):
                assert o == references[PROMPTS[i % 4]]
        assert len(errors) < n_grpc
        for events, _ in http_out:  # an SSE stream on decode-1 ends with an error event and [DONE]
            assert events[-1] == "[DONE]"
            if "error" in events[-2]:
                assert events[-2]["error"]["code"] == "worker_unavailable", events[-2]
            else:
                assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1] if e.get("choices")) > 100
        assert (await live.worker_states())[live.address(live.d1)] == "down"  # out of rotation
        # new requests while decode-1 is hung go to decode-0
        assert await asyncio.gather(*(greedy(live, p, 24) for p in PROMPTS)) == [references[p][:24] for p in PROMPTS]
    finally:
        os.kill(live.d1.proc.pid, signal.SIGCONT)
    back_s = await live.wait_state(live.d1, "up", timeout_s=15)
    served = (await live.stats(live.d1))["requests"]
    assert await asyncio.gather(*(greedy(live, p, 24) for p in PROMPTS)) == [references[p][:24] for p in PROMPTS]
    assert (await live.stats(live.d1))["requests"] > served  # back in rotation
    print(f"\ndecode-1 SIGSTOPped: {len(errors)} stream(s) failed after "
          f"{', '.join(f'{dt:.2f}' for _, dt in errors)} s; back in rotation {back_s:.1f} s after SIGCONT")


async def test_prefill_worker_stopped_mid_prefill(live, references):
    async with RouterClient(live.router) as client:
        before = await client.stats()
    unaffected = asyncio.ensure_future(greedy(live, PROMPTS[0], LONG))  # already decoding
    await asyncio.sleep(0.3)
    states = await live.worker_states()
    os.kill(live.p0.proc.pid, signal.SIGSTOP)  # requests routed to it now hang inside it (and it never dies)
    try:
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(greedy(live, p, 24) for p in PROMPTS)), timeout=30)
        elapsed = time.monotonic() - t0
        assert results == [references[p][:24] for p in PROMPTS]  # the ones on prefill-0 were retried on prefill-1
        assert elapsed < DETECT_BOUND_S
        await live.wait_state(live.p0, "down", timeout_s=DETECT_BOUND_S)
        assert await unaffected == references[PROMPTS[0]]
    finally:
        os.kill(live.p0.proc.pid, signal.SIGCONT)
    async with RouterClient(live.router) as client:
        after = await client.stats()
    retried = after.get("prefill_retries", 0) - before.get("prefill_retries", 0)
    assert retried >= 1, (states, before, after)  # some were routed to the hung worker and moved
    await live.wait_state(live.p0, "up", timeout_s=15)
    served = (await live.stats(live.p0))["requests"]
    assert await asyncio.gather(*(greedy(live, p, 24) for p in PROMPTS)) == [references[p][:24] for p in PROMPTS]
    assert (await live.stats(live.p0))["requests"] > served  # back in rotation
    print(f"\nprefill-0 SIGSTOPped: 4 requests done in {elapsed:.2f} s, {retried:.0f} retried on prefill-1")


# ------------------------------------------------------------------------------------------- graceful shutdown


async def test_sigterm_drains_a_decode_worker(live, references):
    n = 6
    base = [(await live.stats(d))["requests"] for d in (live.d0, live.d1)]
    tasks = [asyncio.ensure_future(grpc_stream(live, PROMPTS[i % 4])) for i in range(n)]
    await decoding_on(live, live.d1, 3)
    while sum([(await live.stats(d))["requests"] for d in (live.d0, live.d1)]) - sum(base) < n:  # all reached decode
        await asyncio.sleep(0.01)
    d0_requests = (await live.stats(live.d0))["requests"]
    live.d1.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while await live.health(live.d1) != health_pb2.HealthCheckResponse.NOT_SERVING:  # at once
        assert time.monotonic() - t0 < 1.0
        await asyncio.sleep(0.02)
    # new work sent straight to it is refused
    stub = decode_pb2_grpc.DecodeServiceStub(live.channel(live.address(live.d1)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Decode(decode_pb2.DecodeRequest(request_id="late", prompt_token_ids=[1, 2, 3],
                                                            sampling=common_pb2.SamplingParams(max_tokens=4))):
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    # a request through the router goes to decode-0 (whether the router has seen NOT_SERVING yet or not)
    assert await greedy(live, PROMPTS[1], 24) == references[PROMPTS[1]][:24]
    assert (await live.stats(live.d0))["requests"] == d0_requests + 1
    assert live.d1.proc.poll() is None  # still draining its streams
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert [o for o, _ in outcomes] == [references[PROMPTS[i % 4]] for i in range(n)]  # all complete and correct
    assert live.d1.proc.wait(timeout=30) == 0
    print(f"\ndecode-1 drained and exited {time.monotonic() - t0:.1f} s after SIGTERM")


async def test_sigterm_drains_the_router(live, references):
    n = 4
    tasks = [asyncio.ensure_future(grpc_stream(live, PROMPTS[i % 4])) for i in range(n - 1)]
    tasks.append(asyncio.ensure_future(sse_stream(live, PROMPTS[3])))
    async with RouterClient(live.router) as client:  # every stream admitted by the router
        while (await client.stats())["streams_open"] < n:
            await asyncio.sleep(0.01)
    await decoding_on(live, live.d0, 1)
    live.router_child.proc.send_signal(signal.SIGTERM)
    async with httpx.AsyncClient(base_url=live.base_url, timeout=10) as http:

        async def draining() -> bool:
            return (await http.get("/health")).status_code == 503

        await wait_until("the router reports draining on /health", draining, timeout_s=10.0)
        r = await http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await greedy(live, PROMPTS[0], 4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    assert [o for o, _ in outcomes[:-1]] == [references[PROMPTS[i % 4]] for i in range(n - 1)]
    events = outcomes[-1][0]
    assert events[-1] == "[DONE]" and "error" not in events[-2]
    assert live.router_child.proc.wait(timeout=30) == 0
