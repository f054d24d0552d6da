"""gRPC interceptors: context on every hop, health checks untraced, streaming spans ended on cancel.

In-process aio servers on loopback ports with an in-memory span exporter; the last test runs the
real prefill and decode servicers (inproc KV transport) and checks the whole span tree.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.services.decode.server import DecodeServicer
from splitserve.services.prefill.server import PrefillServicer
from splitserve.telemetry.interceptors import client_interceptors, server_interceptors
from splitserve.telemetry.tracing import tracer
from splitserve.transfer import create_receiver, create_sender
from tests.telemetry_helpers import Spans
from tests.idle import engine_stats, wait_idle, wait_until

CANCELLED = grpc.StatusCode.CANCELLED.value[0]


@pytest.fixture
def spans(monkeypatch):
    return Spans(monkeypatch)


async def wait_for(predicate, timeout_s=5.0):
    """Poll until ``predicate()`` (spans end on other tasks after a cancellation)."""
    await wait_until("spans ended", predicate, timeout_s, poll_s=0.01)


def _echo(request: bytes, context) -> bytes:
    return request


async def _echo_async(request, context):
    return _echo(request, context)


async def _count(request: bytes, context):
    i = 0
    while True:
        yield str(i).encode()
        i += 1
        await asyncio.sleep(0.005)


async def _broken(request, context):
    raise RuntimeError("handler bug")


def _handler():
    ident = dict(request_deserializer=None, response_serializer=None)
    return grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo_async, **ident),
        "Count": grpc.unary_stream_rpc_method_handler(_count, **ident),
        "Broken": grpc.unary_unary_rpc_method_handler(_broken, **ident),
        "GetStats": grpc.unary_unary_rpc_method_handler(_echo_async, **ident),
    })


@pytest.fixture
async def echo(spans):
    server = grpc.aio.server(interceptors=server_interceptors(spans.provider))
    server.add_generic_rpc_handlers([_handler()])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors(spans.provider))
    yield channel
    await channel.close()
    await server.stop(0)


async def test_context_crosses_the_hop_and_health_checks_are_not_traced(spans, echo):
    with tracer().start_as_current_span("caller") as caller:
        assert await echo.unary_unary("/test.Echo/Echo")(b"hi") == b"hi"
        await health_pb2_grpc.HealthStub(echo).Check(health_pb2.HealthCheckRequest())
    await wait_for(lambda: len([s for s in spans.all() if s.name == "/test.Echo/Echo"]) == 2)
    server, client = sorted((s for s in spans.all() if s.name == "/test.Echo/Echo"), key=lambda s: s.kind.value)
    assert server.kind is SpanKind.SERVER and client.kind is SpanKind.CLIENT
    assert client.parent.span_id == caller.get_span_context().span_id
    assert server.parent.span_id == client.context.span_id
    assert server.context.trace_id == caller.get_span_context().trace_id
    assert not [s for s in spans.all() if "Health" in s.name]


async def test_stats_polls_are_not_traced(spans, echo):
    """The router polls every worker's GetStats once a second: neither side exports a span for it."""
    with tracer().start_as_current_span("caller"):
        assert await echo.unary_unary("/test.Echo/GetStats")(b"poll") == b"poll"
        assert await echo.unary_unary("/test.Echo/Echo")(b"hi") == b"hi"
    await wait_for(lambda: len([s for s in spans.all() if s.name == "/test.Echo/Echo"]) == 2)
    assert not [s for s in spans.all() if s.name.endswith("/GetStats")]


async def test_stream_cancelled_by_the_client_ends_both_spans(spans, echo):
    call = echo.unary_stream("/test.Echo/Count")(b"")
    got = [await call.read() for _ in range(3)]
    assert got == [b"0", b"1", b"2"]
    call.cancel()
    await wait_for(lambda: len([s for s in spans.all() if s.name == "/test.Echo/Count"]) == 2)
    server, client = sorted((s for s in spans.all() if s.name == "/test.Echo/Count"), key=lambda s: s.kind.value)
    assert server.attributes["rpc.grpc.status_code"] == CANCELLED and [e.name for e in server.events] == ["cancelled"]
    assert client.attributes["rpc.grpc.status_code"] == CANCELLED and not spans.is_error(client)  # we chose to stop


async def test_handler_error_sets_error_status(spans, echo):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await echo.unary_unary("/test.Echo/Broken")(b"")
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    await wait_for(lambda: len([s for s in spans.all() if s.name == "/test.Echo/Broken"]) == 2)
    for span in (s for s in spans.all() if s.name == "/test.Echo/Broken"):
        assert spans.is_error(span)


# ------------------------------------------------------------------------------------------ real servicers


@pytest.fixture
async def workers(lm, spans):
    p_engine, d_engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=4)), AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await p_engine.start()
    await d_engine.start()
    sender = create_sender("inproc", p_engine.kv_cache, p_engine.layout)
    receiver = create_receiver("inproc", d_engine.kv_cache, d_engine.layout)
    await sender.start()
    await receiver.start()
    servers, channels = [], []
    for add, servicer in ((prefill_pb2_grpc.add_PrefillServiceServicer_to_server, PrefillServicer(p_engine, sender, "inproc", 5.0)),
                          (decode_pb2_grpc.add_DecodeServiceServicer_to_server, DecodeServicer(d_engine, receiver, "inproc", 5.0))):
        server = grpc.aio.server(interceptors=server_interceptors(spans.provider))
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors(spans.provider)))
    yield prefill_pb2_grpc.PrefillServiceStub(channels[0]), decode_pb2_grpc.DecodeServiceStub(channels[1]), d_engine
    for c in channels:
        await c.close()
    for s in servers:
        await s.stop(0)
    await sender.close()
    await receiver.close()
    await p_engine.stop()
    await d_engine.stop()


async def _prefill_then_decode(prefill, decode, request_id, max_tokens):
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompt = list(range(5, 40))
    resp = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling))
    return decode.Decode(decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                                  kv_handle=resp.kv_handle, first_token_id=resp.first_token_id))


async def test_span_tree_of_one_request_through_the_servicers(spans, workers):
    prefill, decode, _ = workers
    with tracer().start_as_current_span("router request") as root:
        call = await _prefill_then_decode(prefill, decode, "traced-1", 6)
        tokens = [t async for msg in call for t in msg.token_ids]
    assert len(tokens) == 5
    await wait_for(lambda: {"decode.generate", "/pd.v1.DecodeService/Decode"} <= {s.name for s in spans.all() if s.kind is not SpanKind.SERVER})
    by_name = {}
    for s in spans.all():
        by_name.setdefault((s.name, s.kind), s)
    S, C, I = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
    parent_of = {
        ("/pd.v1.PrefillService/Prefill", C): ("router request", I),
        ("/pd.v1.PrefillService/Prefill", S): ("/pd.v1.PrefillService/Prefill", C),
        ("prefill", I): ("/pd.v1.PrefillService/Prefill", S),
        ("/pd.v1.DecodeService/Decode", C): ("router request", I),
        ("/pd.v1.DecodeService/Decode", S): ("/pd.v1.DecodeService/Decode", C),
        ("kv.receive", C): ("/pd.v1.DecodeService/Decode", S),
        ("kv.send", S): ("kv.receive", C),
        ("decode.queue", I): ("/pd.v1.DecodeService/Decode", S),
        ("decode.generate", I): ("/pd.v1.DecodeService/Decode", S),
    }
    for child, parent in parent_of.items():
        assert child in by_name, f"missing {child}; have {sorted(by_name, key=str)}"
        assert by_name[child].parent.span_id == by_name[parent].context.span_id, (child, parent)
        assert by_name[child].context.trace_id == root.get_span_context().trace_id
        assert not spans.is_error(by_name[child]), child


async def test_decode_stream_cancelled_by_the_router(spans, workers):
    prefill, decode, d_engine = workers
    call = await _prefill_then_decode(prefill, decode, "traced-2", 400)
    await call.read()
    await call.read()
    call.cancel()
    await wait_for(lambda: any(s.name == "decode.generate" for s in spans.all())
                   and any(s.name == "/pd.v1.DecodeService/Decode" and s.kind is SpanKind.SERVER for s in spans.all()))
    gen = spans.named("decode.generate")
    server = next(s for s in spans.all() if s.name == "/pd.v1.DecodeService/Decode" and s.kind is SpanKind.SERVER)
    assert spans.is_error(gen) and gen.attributes["splitserve.outcome"] == "cancelled"
    assert server.attributes["rpc.grpc.status_code"] == CANCELLED and server.end_time is not None
    await wait_idle(engine_stats(decode=d_engine), timeout_s=2.0)  # every KV block free: the wrappers leak nothing
