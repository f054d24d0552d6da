"""Role as state: :class:`RoleState` (admission, refusal, drain), and workers whose role changes in place under a
router (in-process: real engines, real gRPC servers, the inproc KV transport, the router's registry and backend).

A switch never fails a request: a stream admitted before it runs to its end on the worker that left decode, a call
the registry still sends to the old role is refused with ABORTED and moved to another worker (which stays in
rotation), and the registry follows the announced role on its next poll. Every KV block is free at the end.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, role_pb2, role_pb2_grpc

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import RoleNotServed
from splitserve.rpc.server import channel
from splitserve.services.router.backend import RoutedBackend
from splitserve.services.router.registry import DECODE, PREFILL, WorkerRegistry
from splitserve.services.worker.roles import BOTH, RoleState
from tests.idle import wait_idle
from tests.role_workers import set_role, start_role_worker

R = common_pb2


def test_role_state_admits_refuses_and_reports_draining():
    roles = RoleState("decode")
    roles.enter("decode")
    with pytest.raises(RoleNotServed):
        roles.enter("prefill")
    assert roles.refused == {"prefill": 1, "decode": 0} and roles.calls == {"prefill": 0, "decode": 1}
    assert roles.set("prefill", "test") == "decode" and roles.switches == 1
    assert roles.draining == "decode"  # the stream admitted before the switch still runs
    with pytest.raises(RoleNotServed):
        roles.enter("decode")
    roles.enter("prefill")
    roles.exit("decode")
    assert roles.draining is None
    roles.set(BOTH)
    roles.enter("decode")
    assert roles.draining is None and roles.counters()["role_takes_decode"] == 1.0
    with pytest.raises(ValueError, match="role must be one of"):
        roles.set("router")
    resp = roles.fill(R.GetStatsResponse())
    assert resp.role == R.WORKER_ROLE_BOTH and resp.draining_role == R.WORKER_ROLE_UNSPECIFIED


async def test_wait_drained_returns_once_the_left_role_is_idle():
    roles = RoleState("decode")
    roles.enter("decode")
    roles.set("prefill")
    assert not await roles.wait_drained(0.01)
    asyncio.get_running_loop().call_later(0.02, roles.exit, "decode")
    assert await roles.wait_drained(30.0)


async def collect(stream) -> list[int]:
    out: list[int] = []
    async with contextlib.aclosing(stream) as events:
        async for ev in events:
            out += ev.token_ids
    return out


@pytest.fixture
async def pair(lm, request):
    """Worker A (prefill) and B (decode, engine slowed so streams are surely in flight; role switch grace period
    ``request.param`` s, default 0), a router backend over both."""
    a = await start_role_worker(lm, "prefill")
    b = await start_role_worker(lm, "decode", step_delay_ms=10, grace_s=getattr(request, "param", 0.0))
    registry = WorkerRegistry([], [], workers=[a.address, b.address])
    backend = RoutedBackend(registry, wait_for_workers_s=5.0)
    await registry.poll_all()
    yield a, b, backend
    await backend.close()
    for w in (a, b):
        await w.stop()


def addresses(backend: RoutedBackend, role: str) -> list[str]:
    return [w.address for w in backend.registry.up(role)]


async def test_switch_under_load_fails_no_request_and_leaks_no_block(pair):
    a, b, backend = pair
    assert addresses(backend, PREFILL) == [a.address] and addresses(backend, DECODE) == [b.address]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = [1, 400, 401, 402, 403, 404, 405]
    reference = await collect(backend.generate("ref", prompt, greedy))
    assert len(reference) == 40

    # three streams decoding on B; then A takes both roles and B leaves decode for prefill
    streams = [backend.generate(f"r{i}", prompt, greedy) for i in range(3)]
    firsts = [(await s.__anext__()).token_ids + (await s.__anext__()).token_ids for s in streams]  # prefill's, then B's
    assert (await set_role(a.address, R.WORKER_ROLE_BOTH)).previous_role == R.WORKER_ROLE_PREFILL
    await backend.registry.poll_all()
    assert sorted(addresses(backend, DECODE)) == sorted([a.address, b.address])
    switched = await set_role(b.address, R.WORKER_ROLE_PREFILL)
    assert switched.previous_role == R.WORKER_ROLE_DECODE and switched.draining_calls >= 1 and not switched.drained
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert [f + rest for f, rest in zip(firsts, results)] == [reference] * 3  # completed, token-exact

    # a Decode call that reaches B now is refused (ABORTED) before anything is allocated
    async with channel(b.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in decode_pb2_grpc.DecodeServiceStub(ch).Decode(decode_pb2.DecodeRequest(request_id="x", prompt_token_ids=prompt)):
                pass
    assert err.value.code() == grpc.StatusCode.ABORTED

    # the registry has not polled B since (and B has no grace period): round robin still sends every other decode leg
    # to B, which refuses it; the request moves to A and B stays in rotation
    results = await asyncio.gather(*(collect(backend.generate(f"s{i}", prompt, greedy)) for i in range(2)))
    assert results == [reference] * 2
    assert backend.counters["decode_retries"] >= 1 and b.roles.refused["decode"] >= 1
    assert all(w.up for w in backend.registry.all())

    # one poll later the registry follows the announced roles
    await backend.registry.poll_all()
    assert addresses(backend, DECODE) == [a.address] and sorted(addresses(backend, PREFILL)) == sorted([a.address, b.address])
    view = {(w["address"], w["role"]): w for w in backend.workers_view()["workers"]}
    assert view[(b.address, DECODE)]["worker_role"] == "prefill" and not view[(b.address, DECODE)]["takes_work"]
    results = await asyncio.gather(*(collect(backend.generate(f"t{i}", prompt, greedy)) for i in range(3)))
    assert results == [reference] * 3

    async def read():
        return {"a": await a.stats(), "b": await b.stats()}, backend.stats()

    await wait_idle(read, timeout_s=10.0)
    assert await b.roles.wait_drained(0.0)


async def test_set_role_waits_for_the_drain_and_refuses_an_unknown_role(pair):
    a, b, backend = pair
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    stream = backend.generate("w", [1, 400, 401], greedy)
    first = (await stream.__anext__()).token_ids + (await stream.__anext__()).token_ids  # prefill's token, then B's
    rest = asyncio.ensure_future(collect(stream))
    await set_role(a.address, R.WORKER_ROLE_DECODE)
    switched = await set_role(b.address, R.WORKER_ROLE_PREFILL, drain_timeout_ms=30_000)
    assert switched.drained and switched.draining_calls == 0 and switched.role == R.WORKER_ROLE_PREFILL
    assert len(first + await rest) == 30
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await set_role(b.address, R.WORKER_ROLE_UNSPECIFIED)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with channel(b.address) as ch:
        got = await role_pb2_grpc.RoleServiceStub(ch).GetRole(role_pb2.GetRoleRequest())
    assert got.role == R.WORKER_ROLE_PREFILL and got.switches == 1 and got.decode_calls == 0


@pytest.mark.parametrize("pair", [60.0], indirect=True)
async def test_a_router_that_learns_late_is_served_within_the_grace_period(pair):
    """A router that has not polled since the switch (it knows no other decode worker) still gets its decode legs
    served by the worker that left decode, for the grace period; the worker announces the new role at once."""
    a, b, backend = pair
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    await set_role(a.address, R.WORKER_ROLE_BOTH)  # the router does not poll: it still sees B as its only decode worker
    switched = await set_role(b.address, R.WORKER_ROLE_PREFILL)
    assert not switched.drained  # grace period: decode is still admitted
    assert addresses(backend, DECODE) == [b.address]
    results = await asyncio.gather(*(collect(backend.generate(f"g{i}", [1, 500, 501], greedy)) for i in range(2)))
    assert [len(r) for r in results] == [12, 12] and b.roles.refused["decode"] == 0 and backend.counters["decode_retries"] == 0
    stats = await b.decode.GetStats(R.GetStatsRequest(), None)
    assert stats.role == R.WORKER_ROLE_PREFILL and stats.draining_role == R.WORKER_ROLE_DECODE
    await backend.registry.poll_all()
    assert addresses(backend, DECODE) == [a.address]


async def test_the_role_command_reads_and_switches_a_worker(lm):
    from splitserve.services.worker.role_cli import role

    w = await start_role_worker(lm, "both")
    try:
        assert await role(w.address) == f"{w.address}: both (0 prefill call(s), 0 decode stream(s) running; 0 switch(es) since start)"
        assert await role(w.address, "decode", wait_s=5.0) == f"{w.address}: both -> decode, drained"
        assert w.roles.role == "decode"
    finally:
        await w.stop()


def test_the_role_command_on_a_worker_without_roles_says_so(capsys):
    """A worker born to one role (or a router) has no RoleService: one clear line, exit 1, not "Method not found"."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from splitserve.services.worker.role_cli import main

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert main([f"127.0.0.1:{port}", "prefill"]) == 1
    finally:
        server.stop(0)
    err = capsys.readouterr().err
    assert "has no RoleService" in err and "splitserve worker" in err
