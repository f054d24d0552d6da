"""Liveness pieces in-process: keepalive settings both sides agree on, draining (gRPC interceptor, HTTP
middleware, the shutdown sequence), the decode stall guard and its failover, and the launcher's stop order.
Real gRPC servers on loopback; real processes only for the launcher (tiny Python children)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import StreamStalled, WorkerUnavailable
from splitserve.frontend.draining import DrainMiddleware
from splitserve.frontend.sse import SSEResponse, sse_event
from splitserve.launcher import Child, Cluster, free_port
from splitserve.rpc import keepalive
from splitserve.rpc.keepalive import KeepaliveConfig, keepalive_from_env
from splitserve.rpc.server import bind, channel, channel_options, create_server, server_options
from splitserve.rpc.shutdown import Drain, ShutdownSignals, check_grace, serve_until_signalled
from splitserve.services.router.config import parse as parse_router
from splitserve.services.router.registry import DECODE
from splitserve.services.router.stall import stall_guard
from tests.inproc_cluster import static_backend

DECODE_METHOD = "/pd.v1.DecodeService/Decode"


@pytest.fixture
def fast_keepalive():
    keepalive.configure(KeepaliveConfig(1.0, 1.0))
    yield
    keepalive.configure(None)


# ------------------------------------------------------------------------------------------- keepalive


def test_keepalive_settings_are_validated_and_agree_on_both_sides():
    with pytest.raises(ValueError, match=">= 1"):
        KeepaliveConfig(0.5, 1)
    with pytest.raises(ValueError, match="> 0"):
        KeepaliveConfig(10, 0)
    assert keepalive_from_env({}) == KeepaliveConfig(10, 5)
    assert keepalive_from_env({"PD_GRPC_KEEPALIVE_TIME_S": "2", "PD_GRPC_KEEPALIVE_TIMEOUT_S": "0.5"}) == KeepaliveConfig(2, 0.5)
    k = KeepaliveConfig(3, 2)
    ch, srv = dict(k.channel_options()), dict(k.server_options())
    for opts in (ch, srv):
        assert opts["grpc.keepalive_time_ms"] == 3000 and opts["grpc.keepalive_timeout_ms"] == 2000
        assert opts["grpc.http2.ping_timeout_ms"] == 2000  # else gRPC waits 60 s for a ping answer
        assert opts["grpc.keepalive_permit_without_calls"] == 1
    assert ch["grpc.min_reconnect_backoff_ms"] == 5000  # connecting to a hung peer fails as fast
    # servers accept pings well below any allowed keepalive time (else GOAWAY too_many_pings)
    assert srv["grpc.http2.min_ping_interval_without_data_ms"] < KeepaliveConfig(1, 1).time_s * 1000
    r = parse_router(["--grpc-keepalive-time-s", "4", "--grpc-keepalive-timeout-s", "3", "--shutdown-grace-s", "0",
                      "--decode-stall-timeout-s", "0"])
    assert r.keepalive == KeepaliveConfig(4, 3) and r.shutdown_grace_s == 0 and r.decode_stall_timeout_s is None
    with pytest.raises(ValueError):
        parse_router(["--shutdown-grace-s", "-1"])
    with pytest.raises(ValueError):
        check_grace(float("nan"))


async def test_process_settings_reach_every_channel_and_server(fast_keepalive):
    assert dict(channel_options())["grpc.keepalive_time_ms"] == 1000
    assert dict(server_options())["grpc.keepalive_time_ms"] == 1000
    keepalive.configure(None)
    assert dict(channel_options())["grpc.keepalive_time_ms"] == 10_000


class _QuietDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Streams ``script`` = [(seconds to wait, token), ...]; records how its handlers ended."""

    def __init__(self, script):
        self.script = script
        self.ended: list[str] = []

    async def Decode(self, request, context):
        try:
            for wait, token in self.script:
                await asyncio.sleep(wait)
                yield decode_pb2.DecodeResponse(token_ids=[token])
            yield decode_pb2.DecodeResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)
            self.ended.append("done")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise


async def _serve(servicer, **kw) -> tuple[grpc.aio.Server, str, object]:
    server, health = create_server(**kw)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    return server, f"127.0.0.1:{port}", health


def _request(rid="r") -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=4))


async def test_a_quiet_stream_is_not_closed_by_keepalive_pings(fast_keepalive):
    """A client pinging every second on a stream that stays quiet is accepted by a server that pings less often
    (a process with a longer keepalive): without the server-side permit gRPC answers the third such ping with
    GOAWAY too_many_pings (~5 s)."""
    servicer = _QuietDecode([(6.5, 7)])
    keepalive.configure(KeepaliveConfig(60.0, 5.0))
    server, address, _ = await _serve(servicer)
    keepalive.configure(KeepaliveConfig(1.0, 1.0))
    try:
        async with channel(address) as ch:
            msgs = [m async for m in decode_pb2_grpc.DecodeServiceStub(ch).Decode(_request())]
        assert [list(m.token_ids) for m in msgs] == [[7], []] and servicer.ended == ["done"]
    finally:
        await server.stop(0)


# ------------------------------------------------------------------------------------------- draining


async def test_draining_refuses_new_work_lets_running_calls_finish_and_keeps_health_and_stats():
    drain = Drain()
    servicer = _QuietDecode([(0.05, t) for t in range(10)])
    server, address, health = await _serve(servicer, drain=drain, work_methods=[DECODE_METHOD])
    signals = ShutdownSignals(install=False)
    serving = asyncio.ensure_future(serve_until_signalled(server, health, ["pd.v1.DecodeService"], drain, grace_s=10,
                                                          name="test", signals=signals))
    try:
        async with channel(address) as ch:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)
            running = stub.Decode(_request("running"))
            first = await running.read()
            assert drain.active == 1
            signals.signal()  # SIGTERM
            await asyncio.sleep(0.05)
            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pd.v1.DecodeService"))
            assert h.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Decode(_request("late")):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            rest = []
            while (m := await running.read()) is not grpc.aio.EOF:  # the running call completes in full
                rest.append(m)
            assert [t for m in [first, *rest] for t in m.token_ids] == list(range(10))
            await asyncio.wait_for(serving, 5)  # drained: the server stops
        assert drain.active == 0 and servicer.ended == ["done"]
    finally:
        await server.stop(0)


async def test_grace_period_ends_the_drain_and_a_second_signal_hurries_it():
    drain = Drain()
    drain.active = 1  # a call that never finishes
    t0 = time.monotonic()
    assert not await drain.wait_idle(0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.0
    hurry = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, hurry.set)
    t0 = time.monotonic()
    assert not await drain.wait_idle(30, hurry=hurry)
    assert time.monotonic() - t0 < 1.0
    drain.active = 0
    busy = [True]
    asyncio.get_running_loop().call_later(0.1, busy.clear)
    assert await drain.wait_idle(5, busy=lambda: bool(busy))  # e.g. KV still held for a decode pull
    assert await Drain().wait_idle(0)  # grace 0: idle at once, or not


async def test_http_requests_during_a_drain():
    drain = Drain()
    release = asyncio.Event()

    async def stream(request):
        async def body():
            yield b"a"
            await release.wait()
            yield b"b"
        return StreamingResponse(body())

    async def ok(request):
        return JSONResponse({"ok": True})

    app = DrainMiddleware(Starlette(routes=[Route("/v1/completions", stream, methods=["POST"]), Route("/health", ok),
                                            Route("/metrics", ok)]), drain)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
        running = asyncio.ensure_future(http.post("/v1/completions"))
        while drain.active == 0:
            await asyncio.sleep(0.01)
        drain.begin()
        for path in ("/health", "/v1/completions"):
            r = await (http.get(path) if path == "/health" else http.post(path))
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"] == "1"
        assert (await http.get("/metrics")).status_code == 200
        release.set()
        assert (await running).content == b"ab"  # the request in flight completes
    assert drain.active == 0


async def test_sse_streams_still_open_when_the_grace_period_ends_get_an_error_event_and_done():
    """No silently truncated stream: at the grace period's end an SSE stream sends a shutting_down error event,
    then [DONE], then ends the body (the backend stream is closed)."""
    drain = Drain()
    closed = asyncio.Event()

    async def events():
        try:
            yield sse_event({"choices": [{"text": "a"}]})
            await asyncio.Event().wait()  # a stream that would go on past the grace period
            yield sse_event({"choices": [{"text": "never"}]})
        finally:
            closed.set()

    async def stream(request):
        return SSEResponse(events())

    app = DrainMiddleware(Starlette(routes=[Route("/v1/completions", stream, methods=["POST"])]), drain)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
        running = asyncio.ensure_future(http.post("/v1/completions"))
        while drain.active == 0:
            await asyncio.sleep(0.01)
        drain.begin()
        await asyncio.sleep(0.05)
        assert not running.done()  # draining alone does not cut a stream
        drain.expired.set()  # what serve_until_signalled does when the grace period runs out
        body = (await asyncio.wait_for(running, 5)).text
    events_seen = [line[len("data: "):] for line in body.split("\n\n") if line]
    assert events_seen[0] == '{"choices": [{"text": "a"}]}'
    assert json.loads(events_seen[1])["error"]["code"] == "shutting_down"
    assert events_seen[2:] == ["[DONE]"]
    assert closed.is_set() and drain.active == 0


# ------------------------------------------------------------------------------------------- stall guard


async def test_stall_guard_ends_a_silent_stream_and_cancels_it():
    servicer = _QuietDecode([(0, 1), (0, 2), (30, 3)])  # two tokens, then silence
    server, address, _ = await _serve(servicer)
    try:
        async with channel(address) as ch:
            call = decode_pb2_grpc.DecodeServiceStub(ch).Decode(_request())
            got = []
            t0 = time.monotonic()
            with pytest.raises(StreamStalled, match="no message for 0.3 s"):
                async for m in stall_guard(call, 0.3, "decode worker x"):
                    got += m.token_ids
                    await asyncio.sleep(0.5)  # a slow consumer: its own time does not count
            assert got == [1, 2] and 0.3 <= time.monotonic() - t0 - 1.0 < 1.0
            assert isinstance(StreamStalled("x"), WorkerUnavailable)
        for _ in range(50):
            if servicer.ended:
                break
            await asyncio.sleep(0.02)
        assert servicer.ended == ["cancelled"]  # the worker stops generating
        async with channel(address) as ch:  # no guard: the stream is left alone
            servicer.script = [(0.2, 5)]
            assert [t async for m in stall_guard(decode_pb2_grpc.DecodeServiceStub(ch).Decode(_request()), None, "x")
                    for t in m.token_ids] == [5]
    finally:
        await server.stop(0)


class _Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    async def Prefill(self, request, context):
        return prefill_pb2.PrefillResponse(request_id=request.request_id, first_token_id=9, kv_handle=common_pb2.KVHandle(
            transfer_id="t", endpoint="127.0.0.1:9", block_ids=[0], num_tokens=2))

    async def ReleaseKV(self, request, context):
        return prefill_pb2.ReleaseKVResponse(released=True)


async def test_a_stalled_decode_worker_is_replaced_before_the_first_token_and_fails_the_stream_after():
    stalled = _QuietDecode([(30, 1)])
    good = _QuietDecode([(0, 1), (0, 2)])
    server, prefill_addr, _ = await _serve_prefill()
    servers = [server]
    for s in (stalled, good):
        srv, addr, _ = await _serve(s)
        servers.append(srv)
        s.address = addr
    backend = static_backend([prefill_addr], [stalled.address, good.address], decode_stall_timeout_s=0.3)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0)
        events = [ev async for ev in backend.generate("r1", [1, 2], params)]
        assert [t for ev in events for t in ev.token_ids] == [9, 1, 2]
        assert backend.counters["decode_stalls"] == 1 and backend.counters["decode_retries"] == 1
        assert [w.up for w in backend.registry.workers[DECODE]] == [False, True]  # the stalled one is out
        assert backend.registry.workers[DECODE][0].last_error == "STALLED"
        good.script = [(0, 1), (30, 2)]  # now the only worker stalls after its first token: a clear error
        got = []
        with pytest.raises(StreamStalled, match=f"decode worker {good.address}"):
            async for ev in backend.generate("r2", [1, 2], params):
                got += ev.token_ids
        assert got == [9, 1] and backend.streams_open == 0
    finally:
        await backend.close()
        for srv in servers:
            await srv.stop(0)


async def _serve_prefill() -> tuple[grpc.aio.Server, str, object]:
    server, health = create_server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(), server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    return server, f"127.0.0.1:{port}", health


# ------------------------------------------------------------------------------------------- launcher


_CHILD = r"""
import signal, socket, sys, time
name, delay, log, port = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
listener = socket.create_server(("127.0.0.1", port)) if port else None
def on_term(*_):
    open(log, "a").write(f"{name} term {time.monotonic()}\n")
    if listener:
        listener.close()  # drained: stops accepting, then takes its time to exit
        open(log, "a").write(f"{name} closed {time.monotonic()}\n")
    time.sleep(delay)
    open(log, "a").write(f"{name} exit {time.monotonic()}\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(log, "a").write(f"{name} ready {time.monotonic()}\n")
while True:
    time.sleep(0.05)
"""


def test_cluster_stops_the_router_first_then_the_workers_then_the_store(tmp_path):
    log = tmp_path / "log"
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    port = free_port()
    children = [Child(name, [sys.executable, str(script), name, delay, str(log), str(p)], health)
                for name, delay, p, health in (("prefill-0", "0", 0, ""), ("decode-0", "0.2", 0, ""), ("kvstore-master", "0", 0, ""),
                                               ("router", "1.0", port, f"http://127.0.0.1:{port}/health"))]
    cluster = Cluster(children)
    cluster.start()
    t0 = time.monotonic()
    while not log.exists() or log.read_text().count("ready") < 4:
        assert time.monotonic() - t0 < 20
        time.sleep(0.05)
    cluster.stop(grace_s=10)
    events = {}
    for line in log.read_text().splitlines():
        name, what, t = line.split()
        events[(name, what)] = float(t)
    # the workers are stopped once the router has drained (closed its port), while it exits
    assert events[("router", "closed")] <= min(events[("prefill-0", "term")], events[("decode-0", "term")]) < events[("router", "exit")]
    assert max(events[("prefill-0", "exit")], events[("decode-0", "exit")]) <= events[("kvstore-master", "term")]
    assert all(c.proc.returncode == 0 for c in children)
    hung = Child("router", [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                            "time.sleep(60)"], "")
    cluster = Cluster([hung])
    cluster.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    cluster.stop(grace_s=0.5)  # past the grace period: killed
    assert time.monotonic() - t0 < 5 and hung.proc.returncode == -9
