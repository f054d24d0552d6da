"""The queue-wait bound end to end, in one process (real engines and gRPC servers, inproc KV transport, the
router's backend and HTTP app). The workers' engine clocks are injected, so no test sleeps until a bound.

A prefill worker whose pool stays held past ``max_queue_wait_s`` answers RESOURCE_EXHAUSTED and the router
retries elsewhere (another prefill worker, else prefill on the decode worker); when every worker is exhausted the client gets
HTTP 503 with Retry-After and an OpenAI error body. Nothing leaks either way."""

from __future__ import annotations

import asyncio


from tests.inproc_cluster import InprocCluster

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def stats_of(worker) -> dict:
    return await worker.engine.stats()


async def until_waiting(worker, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        s = await stats_of(worker)
        if s["requests_waiting"] + s["kv_allocations_waiting"] >= 1:
            return
        assert loop.time() - t0 < timeout_s, f"nothing waits on {worker.address}: {s}"
        await asyncio.sleep(0.01)


def expire(worker, clock: Clock) -> None:
    """Let the worker's queue bound pass (on its injected clock) and wake its engine."""
    clock.now += worker.engine.config.max_queue_wait_s
    worker.engine.core.wake()


async def started(lm, num_prefill: int = 1) -> tuple[InprocCluster, list[Clock]]:
    c = await InprocCluster(lm, num_prefill=num_prefill).start()
    clocks = []
    for w in c.prefill + c.decode:
        clock = Clock()
        w.engine.core.admission.clock = clock
        clocks.append(clock)
    return c, clocks


async def test_a_prefill_worker_past_its_queue_bound_is_retried_elsewhere(lm):
    c, (p_clock, _) = await started(lm)
    try:
        async with c.http() as http:
            ref = (await http.post("/v1/completions", json=BODY)).json()["choices"][0]["text"]
            held = await c.prefill[0].engine.allocate_blocks(c.prefill[0].engine.num_blocks)  # e.g. leases not pulled yet
            request = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
            await until_waiting(c.prefill[0])
            expire(c.prefill[0], p_clock)
            r = await request
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
        assert c.backend.counters["local_prefill_fallbacks"] == 1
        assert (await stats_of(c.prefill[0]))["queue_timeouts"] == 1
        held.free()
        await c.wait_idle()
    finally:
        await c.stop()


async def test_the_router_retries_a_prefill_worker_past_its_queue_bound_on_another_one(lm):
    c, clocks = await started(lm, num_prefill=2)
    try:
        held = [await w.engine.allocate_blocks(w.engine.num_blocks) for w in c.prefill]
        async with c.http() as http:
            request = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
            first = await first_waiting(c.prefill)
            expire(c.prefill[first], clocks[first])
            other = 1 - first
            await until_waiting(c.prefill[other])  # the retry waits its turn there
            held[other].free()  # e.g. its leases are released
            r = await request
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
        assert c.backend.counters["prefill_retries"] == 1 and c.backend.counters["local_prefill_fallbacks"] == 0
        held[first].free()
        await c.wait_idle()
    finally:
        await c.stop()


async def first_waiting(workers, timeout_s: float = 30.0) -> int:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        for i, w in enumerate(workers):
            if (await stats_of(w))["requests_waiting"]:
                return i
        assert loop.time() - t0 < timeout_s, "no prefill worker got the request"
        await asyncio.sleep(0.01)


async def test_every_worker_past_its_queue_bound_is_http_503_with_retry_after(lm):
    c, (p_clock, d_clock) = await started(lm)
    try:
        held = [await w.engine.allocate_blocks(w.engine.num_blocks) for w in (c.prefill[0], c.decode[0])]
        async with c.http() as http:
            request = asyncio.ensure_future(http.post("/v1/completions", json=BODY))
            await until_waiting(c.prefill[0])
            expire(c.prefill[0], p_clock)
            await until_waiting(c.decode[0])  # the router's fallback: the decode worker prefills, and waits too
            expire(c.decode[0], d_clock)
            r = await request
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "capacity_exhausted" and err["type"] == "server_error" and "waited" in err["message"]
        for blocks in held:
            blocks.free()
        await c.wait_idle()
        async with c.http() as http:  # the next request succeeds
            assert (await http.post("/v1/completions", json=BODY)).status_code == 200
    finally:
        await c.stop()
