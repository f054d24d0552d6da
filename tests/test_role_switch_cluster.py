"""Role switches under load on a real local cluster: a router and three `splitserve worker` processes (gRPC control,
UCX KV transfer; engines slowed by fault injection so streams are surely in flight), no KV store.

While streams decode on a worker, it switches to prefill (and the prefill worker to decode), with more requests
arriving during the switch: no request fails, every one gets the greedy tokens of a run without switches, the
router's ``GET /v1/workers`` follows the roles the workers announce, and at the end every KV block is free.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, decode_pb2_grpc, role_pb2, role_pb2_grpc

from splitserve.launcher import build_cluster
from splitserve.paths import default_model_path
from tests.cluster import TEST_ENV, grpc_address
from tests.idle import wait_idle_sync, wait_until
from tests.sse_events import sse

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.cluster]

MODEL = default_model_path().name
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def elastic_cluster():
    cluster, http_port, _ = build_cluster(
        model=str(default_model_path()), num_prefill=1, num_decode=2, http_port=0, grpc_port=0, elastic=True,
        worker_args=["--kv-cache-mb", "32", "--role-switch-grace-s", "1"], router_args=["--poll-interval-s", "0.5"],
        env={**TEST_ENV, "PD_FAULT_STEP_DELAY_MS": "25"},
    )
    cluster.start()
    try:
        cluster.wait_healthy(timeout_s=120)
        yield cluster, f"http://127.0.0.1:{http_port}"
    finally:
        cluster.stop()


def set_role(address: str, role: int) -> role_pb2.SetRoleResponse:
    with grpc.insecure_channel(address) as ch:
        return role_pb2_grpc.RoleServiceStub(ch).SetRole(role_pb2.SetRoleRequest(role=role, reason="test"), timeout=10)


def read_stats(cluster) -> tuple[dict[str, dict], None]:
    out = {}
    for child in cluster.children:
        if child.name.startswith(("prefill", "decode")):
            with grpc.insecure_channel(grpc_address(cluster, child.name)) as ch:
                out[child.name] = dict(decode_pb2_grpc.DecodeServiceStub(ch).GetStats(common_pb2.GetStatsRequest(), timeout=5).counters)
    return out, None


async def completion(http: httpx.AsyncClient, prompt: str, started: asyncio.Event | None = None) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    text, chunks = "", 0
    async for event in sse(http, "/v1/completions", body):
        text += event["choices"][0]["text"]
        chunks += 1
        if started is not None and chunks == 3:  # decoding on a decode worker by now
            started.set()
    return text


async def roles_seen(http: httpx.AsyncClient) -> dict[str, str | None]:
    workers = (await http.get("/v1/workers")).json()["workers"]
    return {w["address"]: w["worker_role"] for w in workers}


async def test_switching_roles_under_load_fails_no_request_and_leaks_no_block(elastic_cluster):
    cluster, base_url = elastic_cluster
    prefill, decode0 = grpc_address(cluster, "prefill-0"), grpc_address(cluster, "decode-0")
    prompts = [f"Once upon a time, a {animal} named" for animal in ("cat", "dog", "fox", "owl", "bee", "cow")]
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        reference = await asyncio.gather(*(completion(http, p) for p in prompts))
        assert all(reference)
        started = [asyncio.Event() for _ in prompts]
        streams = [asyncio.ensure_future(completion(http, p, s)) for p, s in zip(prompts, started)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        loop = asyncio.get_running_loop()
        left = await loop.run_in_executor(None, set_role, decode0, common_pb2.WORKER_ROLE_PREFILL)
        assert left.previous_role == common_pb2.WORKER_ROLE_DECODE and left.draining_calls >= 1
        during = [asyncio.ensure_future(completion(http, p)) for p in prompts]  # arrive while decode-0 drains
        await wait_until("the router follows decode-0's switch", lambda: _role_is(http, decode0, "prefill"), 30, 0.1)
        moved = await loop.run_in_executor(None, set_role, prefill, common_pb2.WORKER_ROLE_DECODE)
        assert moved.previous_role == common_pb2.WORKER_ROLE_PREFILL
        after = [asyncio.ensure_future(completion(http, p)) for p in prompts]
        results = await asyncio.gather(*streams, *during, *after)  # any failed request raises here
        assert results == reference * 3
        await wait_until("the router follows prefill-0's switch", lambda: _role_is(http, prefill, "decode"), 30, 0.1)
    stats, _ = read_stats(cluster)
    assert stats["decode-0"]["role_switches"] == 1 and stats["prefill-0"]["role_switches"] == 1
    wait_idle_sync(lambda: read_stats(cluster), timeout_s=30)  # every KV block free, nothing running or held


async def _role_is(http: httpx.AsyncClient, address: str, role: str) -> bool:
    return (await roles_seen(http))[address] == role
