"""Tracing configuration from OTEL_* variables, the /metrics exposition, and the UCX control message."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from splitserve.telemetry import metrics as _metrics  # registers every metric
from splitserve.telemetry import tracing
from splitserve.telemetry.asgi import metrics_route
from splitserve.telemetry.exposition import check_metrics_port, register_engine, start_metrics_server
from splitserve.transfer import wire


def test_exporters_and_protocol_from_the_environment(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.exporter_names() == []  # nothing configured: tracing stays off
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert tracing.exporter_names() == ["otlp"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, otlp")
    assert tracing.exporter_names() == ["console", "otlp"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.exporter_names() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        tracing.exporter_names()
    assert tracing.otlp_protocol() == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert tracing.otlp_protocol() == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        tracing.otlp_protocol()


_CHILD = """
import json, sys
from splitserve.telemetry.tracing import setup_tracing, tracer, tracing_enabled
from splitserve.telemetry.interceptors import server_interceptors
provider = setup_tracing("splitserve-test")
print(json.dumps({"on": provider is not None, "enabled": tracing_enabled(), "interceptors": len(server_interceptors())}))
with tracer().start_as_current_span("hello"):
    pass
sys.stdout.flush()
"""


def _child(**env) -> tuple[dict, str]:
    import json

    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, _, rest = out.stdout.partition("\n")
    return json.loads(first), rest


def test_console_exporter_and_sdk_disabled():
    state, rest = _child(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="my-router")
    assert state == {"on": True, "enabled": True, "interceptors": 1}
    assert '"name": "hello"' in rest and '"service.name": "my-router"' in rest  # flushed at exit
    state, rest = _child(OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true")
    assert state == {"on": False, "enabled": False, "interceptors": 0} and "hello" not in rest
    state, _ = _child()
    assert state["on"] is False
    state, rest = _child(OTEL_TRACES_EXPORTER="console", OTEL_TRACES_SAMPLER="always_off")
    assert state["on"] is True and "hello" not in rest  # the SDK reads the sampler


def test_otlp_protocol_selects_the_exporter(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert isinstance(tracing._exporter("otlp"), HttpExporter)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert isinstance(tracing._exporter("otlp"), GrpcExporter)


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_metric_is_prefixed_and_in_base_units():
    registry = CollectorRegistry()
    _metrics.expose(*_metrics.GROUPS, registry=registry)
    _metrics.expose("frontend", registry=registry)  # idempotent
    with pytest.raises(ValueError, match="bogus"):
        _metrics.expose("bogus")
    families = _families(generate_latest(registry).decode())
    ours = {n: f for n, f in families.items() if n.startswith("splitserve")}
    assert len({m.name for m in registry.collect()}) == sum(len(group) for group in _metrics.GROUPS.values()) > 20
    for name, family in ours.items():
        assert name.startswith("splitserve:"), name
        if family.type == "histogram":
            assert name.endswith("_seconds"), name


def _fake_engine(free=6, total=8):
    bm = SimpleNamespace(num_blocks=total, num_free=free)
    sched = SimpleNamespace(running=[1, 2], waiting=[3], num_block_waits=4)
    admission = SimpleNamespace(waiters=[7], num_block_waits=1, num_timed_out=2, num_refused=0)
    core = SimpleNamespace(scheduler=sched, admission=admission, num_steps=5, num_prefill_tokens=40, num_decode_tokens=9)
    return SimpleNamespace(block_manager=bm, core=core)


def test_worker_metrics_server_serves_engine_gauges():
    registry = CollectorRegistry()
    register_engine(_fake_engine(), registry, gauges={"splitserve:kv_leases_held": ("held", lambda: 3)})
    server = start_metrics_server("127.0.0.1", 0, registry)
    try:
        text = httpx.get(server.url, timeout=5).text
    finally:
        server.close()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["splitserve:kv_blocks_used"] == 2 and values["splitserve:kv_blocks_free"] == 6
    assert values["splitserve:kv_cache_usage_perc"] == 0.25
    assert values["splitserve:num_requests_running"] == 2 and values["splitserve:num_requests_waiting"] == 1
    assert values["splitserve:engine_decode_tokens_total"] == 9 and values["splitserve:kv_leases_held"] == 3
    assert values["splitserve:num_kv_allocations_waiting"] == 1 and values["splitserve:kv_block_waits_total"] == 5
    assert values["splitserve:queue_timeouts_total"] == 2 and values["splitserve:queue_refused_total"] == 0
    assert start_metrics_server("127.0.0.1", -1) is None
    for bad in (-2, 70000):
        with pytest.raises(ValueError, match="metrics_port"):
            check_metrics_port(bad)


def test_worker_metrics_server_drops_idle_and_half_sent_connections_and_caps_them():
    import socket

    server = start_metrics_server("127.0.0.1", 0, CollectorRegistry(), read_timeout_s=0.3, max_connections=2)
    try:
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        half = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        half.sendall(b"GET /metrics HTTP/1.1\r\nHo")
        over = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # a third, beyond the cap
        assert over.recv(100).startswith(b"HTTP/1.1 503")
        for sock in (idle, half):  # closed by the server after the read timeout (recv returns b"" at EOF)
            assert sock.recv(100) == b""
        assert httpx.get(server.url, timeout=5).status_code == 200  # slots are free again
        for sock in (idle, half, over):
            sock.close()
    finally:
        server.close()


async def test_metrics_route_on_a_starlette_app():
    registry = CollectorRegistry()
    register_engine(_fake_engine(free=8), registry)
    app = Starlette(routes=[metrics_route(registry=registry)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = _families(r.text)
    assert "splitserve:kv_blocks_used" in families and "splitserve:time_to_first_token_seconds" in families


def test_fetch_message_carries_the_trace_context():
    ctx = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    plain = wire.FetchRequest(0xA5 << 56 | 7 << 24, 65536, 123, "tid", [(5, 3), (12, 1)])
    traced = wire.FetchRequest(plain.tag_base, 65536, 123, "tid", [(5, 3), (12, 1)], ctx)
    assert wire.decode_fetch(wire.encode_fetch(traced)) == traced
    old_format = wire.encode_fetch(plain)  # no context: the original message, byte for byte
    assert old_format[6:8] == b"\x00\x00" and len(old_format) == 40 + 3 + 16
    assert len(wire.encode_fetch(traced)) == len(old_format) + 2 + len(ctx)
    with pytest.raises(wire.WireError):
        wire.decode_fetch(wire.encode_fetch(traced)[:-1])
    with pytest.raises(wire.WireError):
        wire.decode_fetch(old_format[:6] + b"\x01\x00" + old_format[8:])  # flag without a context
    too_long = wire.FetchRequest(plain.tag_base, 65536, 123, "tid", [(5, 3)], "x" * 600)
    assert wire.decode_fetch(wire.encode_fetch(too_long)).trace_context == ""  # dropped, never fatal
