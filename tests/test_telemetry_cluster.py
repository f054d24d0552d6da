"""Traces and metrics of a real local cluster (router, prefill and decode processes, KV over UCX).

The processes export with the standard OTLP/gRPC exporter to a receiver in this test process
(built on opentelemetry-proto's TraceService); /metrics of every process is parsed with the
Prometheus text parser.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import RouterClient
from splitserve.launcher import free_port
from splitserve.model import load_model
from splitserve.paths import default_model_path
from splitserve.telemetry.receiver import STATUS_ERROR, OTLPReceiver
from tests.cluster import TEST_ENV, read_up_banner, restore, snapshot, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "TinyStories-656K"
BLOCK = 16
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between batch exports
SERVER, CLIENT, INTERNAL = 2, 3, 1  # OTLP span kinds
WORKER_SERVICES = {"splitserve-router", "splitserve-prefill", "splitserve-decode"}


@pytest.fixture(scope="module")
def traced_cluster():
    receiver = OTLPReceiver().start()
    cluster, base_url, grpc_address = start_cluster(env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **FAST_EXPORT})
    yield receiver, base_url, grpc_address, cluster, snapshot(cluster)
    cluster.stop()
    receiver.stop()


@pytest.fixture
def traced(traced_cluster):
    """(receiver, base url, router gRPC address, cluster): the module's cluster with every process up again (a
    test kills the decode worker)."""
    receiver, base_url, grpc_address, cluster, argv = traced_cluster
    restore(cluster, argv)
    return receiver, base_url, grpc_address, cluster


def in_trace(spans, trace_id):
    return [s for s in spans if s.trace_id == trace_id]


def one(spans, name, kind=None, service=None):
    found = [s for s in spans if s.name == name and (kind is None or s.kind == kind) and (service is None or s.service == service)]
    assert len(found) == 1, f"{name}/{kind}/{service}: {len(found)} of {[(s.service, s.name) for s in spans]}"
    return found[0]


def request_span(receiver, request_id, timeout_s=30.0):
    """The router's GenAI span of ``request_id`` (once exported)."""
    spans = receiver.wait_for(lambda ss: any(s.attributes.get("gen_ai.response.id") == request_id for s in ss), timeout_s)
    return next(s for s in spans if s.attributes.get("gen_ai.response.id") == request_id)


REQUEST_TREE = {  # (name, kind, service) -> its parent
    ("/pd.v1.PrefillService/Prefill", CLIENT, "splitserve-router"): "request",
    ("/pd.v1.PrefillService/Prefill", SERVER, "splitserve-prefill"): ("/pd.v1.PrefillService/Prefill", CLIENT, "splitserve-router"),
    ("prefill", INTERNAL, "splitserve-prefill"): ("/pd.v1.PrefillService/Prefill", SERVER, "splitserve-prefill"),
    ("/pd.v1.DecodeService/Decode", CLIENT, "splitserve-router"): "request",
    ("/pd.v1.DecodeService/Decode", SERVER, "splitserve-decode"): ("/pd.v1.DecodeService/Decode", CLIENT, "splitserve-router"),
    ("kv.receive", CLIENT, "splitserve-decode"): ("/pd.v1.DecodeService/Decode", SERVER, "splitserve-decode"),
    ("kv.send", SERVER, "splitserve-prefill"): ("kv.receive", CLIENT, "splitserve-decode"),
    ("decode.queue", INTERNAL, "splitserve-decode"): ("/pd.v1.DecodeService/Decode", SERVER, "splitserve-decode"),
    ("decode.generate", INTERNAL, "splitserve-decode"): ("/pd.v1.DecodeService/Decode", SERVER, "splitserve-decode"),
}


def check_request_tree(receiver, request, front_door: tuple[str, int, str] | None = None):
    """Wait for the whole trace of one request (and its ``front_door`` span, (name, kind, service): the router's
    HTTP or gRPC server span ends after the response, so it may be exported after the rest) and check every
    parent link."""
    wanted = [*REQUEST_TREE, *([front_door] if front_door else [])]

    def complete(ss):  # every span of the tree has arrived (store calls add more spans, so not a count)
        mine = in_trace(ss, request.trace_id)
        return all(any(s.name == n and s.kind == k and s.service == v for s in mine) for n, k, v in wanted)

    spans = in_trace(receiver.wait_for(complete), request.trace_id)
    for (name, kind, service), parent in REQUEST_TREE.items():
        child = one(spans, name, kind, service)
        parent_span = request if parent == "request" else one(spans, *parent)
        assert child.parent_id == parent_span.span_id, (name, kind, service)
        assert child.status_code != STATUS_ERROR and child.end_ns >= child.start_ns, (name, child.status_message)
    return spans


async def test_one_request_is_one_trace_across_router_prefill_transfer_and_decode(traced):
    receiver, base_url, _, _ = traced
    body = {"model": MODEL, "prompt": "Once upon a time there was a dragon", "max_tokens": 12, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200
    request = request_span(receiver, r.headers["x-request-id"])
    assert request.service == "splitserve-router" and request.name == f"text_completion {MODEL}"
    assert request.attributes["gen_ai.usage.output_tokens"] == 12 and request.attributes["gen_ai.server.time_to_first_token"] > 0
    spans = check_request_tree(receiver, request, ("POST /v1/completions", SERVER, "splitserve-router"))
    http_span = one(spans, "POST /v1/completions", SERVER, "splitserve-router")
    assert request.parent_id == http_span.span_id and http_span.parent_id == ""  # no client context: a new trace
    assert {s.service for s in spans} == WORKER_SERVICES
    receive, send = one(spans, "kv.receive"), one(spans, "kv.send")
    assert receive.attributes["splitserve.kv.bytes"] == send.attributes["splitserve.kv.bytes"] > 0
    assert receive.attributes["splitserve.kv.transport"] == "ucx" and receive.attributes["splitserve.kv.gbps"] > 0
    assert one(spans, "decode.generate").attributes["gen_ai.usage.output_tokens"] == 11  # the first came from prefill
    assert not [s for s in receiver.spans() if "Health" in s.name]


async def test_client_traceparent_is_continued(traced):
    receiver, base_url, _, _ = traced
    trace_id, parent_id = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 6, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        r = await http.post("/v1/chat/completions", json=body, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    assert r.status_code == 200, r.text
    request = request_span(receiver, r.json()["id"])
    assert request.trace_id == trace_id and request.name == f"chat {MODEL}"
    spans = check_request_tree(receiver, request, ("POST /v1/chat/completions", SERVER, "splitserve-router"))
    assert one(spans, "POST /v1/chat/completions", SERVER).parent_id == parent_id


async def test_grpc_front_door_is_traced_too(traced):
    receiver, _, grpc_address, _ = traced
    async with RouterClient(grpc_address) as client:
        request_id = [r.request_id async for r in client.generate("Once upon a time", max_tokens=5, temperature=0.0)][0]
    request = request_span(receiver, request_id)
    spans = check_request_tree(receiver, request, ("/pd.v1.RouterService/Generate", SERVER, "splitserve-router"))
    assert request.parent_id == one(spans, "/pd.v1.RouterService/Generate", SERVER, "splitserve-router").span_id


async def test_stream_cancelled_by_the_client_still_exports_ended_error_spans(traced):
    receiver, base_url, _, _ = traced
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events == 4:
                    break  # leaving the block closes the connection mid-stream
    request = request_span(receiver, request_id)
    assert request.status_code == STATUS_ERROR and request.attributes["splitserve.outcome"] == "cancelled"
    assert request.end_ns > request.start_ns and request.attributes["gen_ai.usage.output_tokens"] < 400

    def decode_side_ended(spans):
        mine = in_trace(spans, request.trace_id)
        return any(s.name == "decode.generate" for s in mine) and any(s.name == "/pd.v1.DecodeService/Decode" and s.kind == SERVER for s in mine)

    spans = in_trace(receiver.wait_for(decode_side_ended), request.trace_id)
    generate = one(spans, "decode.generate")
    server = one(spans, "/pd.v1.DecodeService/Decode", SERVER)
    assert generate.status_code == STATUS_ERROR and generate.attributes["splitserve.outcome"] == "cancelled"
    assert server.attributes["rpc.grpc.status_code"] == 1  # CANCELLED (not an error status: gRPC conventions)


def metric_values(url: str) -> dict:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def value(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_of_every_service_parse_and_move(traced):
    _, base_url, _, cluster = traced
    urls = {c.name: c.metrics for c in cluster.children}
    assert set(urls) == {"prefill-0", "decode-0", "router", "kvstore-master", "kvstore-node-0"}
    before = {name: metric_values(url) for name, url in urls.items()}
    body = {"model": MODEL, "prompt": "One day a little bird flew over the big green hill and sang", "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        r = await http.post("/v1/completions", json=body)
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    after = {name: metric_values(url) for name, url in urls.items()}
    m = {"model_name": MODEL}

    def moved(service, name, **labels):
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    assert moved("router", "splitserve:time_to_first_token_seconds_count", **m) == 1
    assert moved("router", "splitserve:inter_token_latency_seconds_count", **m) == 9
    assert moved("router", "splitserve:request_time_per_output_token_seconds_count", **m) == 1
    assert moved("router", "splitserve:e2e_request_latency_seconds_count", **m) == 1
    assert moved("router", "splitserve:requests_total", outcome="length", **m) == 1
    assert moved("router", "splitserve:generation_tokens_total", **m) == 10
    assert moved("router", "splitserve:disagg_decisions_total", decision="remote_prefill") == 1
    cfg = load_model(default_model_path()).config
    kv_bytes = prompt_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # the used token rows only
    assert moved("prefill-0", "splitserve:kv_transfer_bytes_total", direction="send", transport="ucx", path="host") == kv_bytes
    assert moved("decode-0", "splitserve:kv_transfer_bytes_total", direction="receive", transport="ucx", path="host") == kv_bytes
    assert moved("decode-0", "splitserve:kv_transfer_seconds_count", direction="receive", transport="ucx", path="host") == 1
    assert moved("prefill-0", "splitserve:request_prefill_time_seconds_count") == 1
    assert moved("decode-0", "splitserve:request_decode_time_seconds_count") == 1
    assert value(after["decode-0"], "splitserve:kv_blocks_free") > 0
    assert value(after["prefill-0"], "splitserve:kv_leases_held") == 0
    names = {service: {n for n, _ in values} for service, values in after.items()}
    assert "splitserve:request_decode_time_seconds_count" not in names["router"]  # each shows its own metrics
    assert "splitserve:time_to_first_token_seconds_count" not in names["decode-0"]
    # the KV store: the prompt's full blocks were written (master puts, node bytes) and looked up first
    full_blocks = prompt_tokens // BLOCK
    for _ in range(100):  # the store writes happen in the background, after the first token
        if moved("kvstore-master", "splitserve:kv_store_puts_completed_total") >= full_blocks:
            break
        await asyncio.sleep(0.05)
        after = {name: metric_values(url) for name, url in urls.items()}
    assert moved("kvstore-master", "splitserve:kv_store_puts_completed_total") == full_blocks
    assert value(after["kvstore-master"], "splitserve:kv_store_capacity_bytes") > 0
    assert moved("kvstore-node-0", "splitserve:kv_store_node_ucx_bytes_written_total") == full_blocks * BLOCK * (kv_bytes // prompt_tokens)
    assert any(n.startswith("splitserve:kv_store_client_") for n in names["prefill-0"])


async def test_decode_worker_killed_mid_stream_ends_the_router_spans_with_errors(traced):
    """Kills the decode worker (the ``traced`` fixture starts it again for the next test)."""
    receiver, base_url, _, cluster = traced
    decode = next(c for c in cluster.children if c.name == "decode-0")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            lines = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 4 and decode.proc.poll() is None:
                    decode.proc.kill()
    assert lines[-1] == "data: [DONE]" and any('"error"' in line for line in lines)
    request = request_span(receiver, request_id)
    assert request.status_code == STATUS_ERROR and request.attributes["splitserve.outcome"] == "error"
    spans = in_trace(receiver.wait_for(lambda ss: any(s.name == "/pd.v1.DecodeService/Decode" and s.kind == CLIENT
                                                      for s in in_trace(ss, request.trace_id))), request.trace_id)
    call = one(spans, "/pd.v1.DecodeService/Decode", CLIENT)
    assert call.status_code == STATUS_ERROR and call.attributes["rpc.grpc.status_code"] == 14  # UNAVAILABLE


def test_up_trace_wires_every_process_and_prints_metrics_endpoints():
    http_port, grpc_port = free_port(), free_port()
    with OTLPReceiver() as receiver:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
             "--kv-cache-mb", "32", "--trace", "--otlp-endpoint", receiver.endpoint],
            env={**os.environ, **TEST_ENV, **FAST_EXPORT}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            lines = read_up_banner(proc)
            out = "".join(lines)
            assert f"OTLP to {receiver.endpoint}" in out, out
            urls = [w for line in lines for w in line.split() if w.endswith("/metrics")]
            assert len(urls) == 5 and f"http://127.0.0.1:{http_port}/metrics" in urls, out  # router, 2 workers, store master + node
            r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",
                           json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200
            for url in urls:
                assert any(f.name.startswith("splitserve:") for f in text_string_to_metric_families(httpx.get(url, timeout=10).text))
            request = request_span(receiver, r.json()["id"])
            receiver.wait_for(lambda ss: {s.service for s in in_trace(ss, request.trace_id)} == WORKER_SERVICES)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
