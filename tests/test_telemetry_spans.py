"""Manual spans and the metrics recorded with them (in-process, in-memory span exporter, fake clocks)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from opentelemetry.trace import SpanKind

from splitserve.errors import TransferNotFound, WorkerUnavailable
from splitserve.frontend.pipeline import TextDelta
from splitserve.telemetry.propagation import context_from, current_trace_context
from splitserve.telemetry.requests import observe_request
from splitserve.telemetry.store import observe_store_op
from splitserve.telemetry.tracing import tracer
from splitserve.telemetry.transfer import observe_receive
from splitserve.telemetry.workers import observe_decode, observe_prefill
from splitserve.transfer import create_receiver, create_sender
from splitserve.transfer.kv_cache import allocate_kv_cache
from splitserve.transfer.layout import KVLayout
from tests.telemetry_helpers import FakeClock, Spans, sample


@pytest.fixture
def spans(monkeypatch):
    return Spans(monkeypatch)


async def deltas(*items, fail: Exception | None = None, child_span: bool = False):
    for i, item in enumerate(items):
        if child_span and i == 0:
            with tracer().start_as_current_span("backend.call"):
                pass
        yield item
    if fail is not None:
        raise fail


def hist(name: str, model: str) -> tuple[float, float]:
    return sample(f"{name}_count", model_name=model), sample(f"{name}_sum", model_name=model)


async def test_request_span_and_latency_metrics(spans):
    model = "m-full"
    items = [TextDelta("a", [1]), TextDelta("b", [2]), TextDelta("c", [3], "length")]
    clock = FakeClock(0.0, 1.0, 1.5, 2.5, 3.0)  # start, three deltas, end
    params = SimpleNamespace(max_tokens=3, temperature=0.0, top_p=1.0, top_k=-1, seed=7)
    got = [d async for d in observe_request(deltas(*items, child_span=True), model=model, request_id="chatcmpl-1",
                                            prompt_tokens=5, params=params, clock=clock)]
    assert got == items
    assert hist("splitserve:time_to_first_token_seconds", model) == (1, 1.0)
    assert hist("splitserve:inter_token_latency_seconds", model) == (2, 1.5)
    assert hist("splitserve:request_time_per_output_token_seconds", model) == (1, 0.75)
    assert hist("splitserve:e2e_request_latency_seconds", model) == (1, 3.0)
    assert sample("splitserve:requests_total", model_name=model, outcome="length") == 1
    assert sample("splitserve:generation_tokens_total", model_name=model) == 3
    assert sample("splitserve:prompt_tokens_total", model_name=model) == 5
    assert sample("splitserve:num_requests_in_flight", model_name=model) == 0
    span = spans.named("chat m-full")
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == model
    assert a["gen_ai.usage.input_tokens"] == 5 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.server.time_to_first_token"] == 1.0
    assert a["gen_ai.request.seed"] == 7 and a["splitserve.itl.max_s"] == 1.0
    assert not spans.is_error(span)
    assert spans.named("backend.call").parent.span_id == span.context.span_id  # backend RPCs are children


async def test_request_closed_by_client_is_cancelled_with_error_status(spans):
    model = "m-cancel"
    stream = observe_request(deltas(TextDelta("a", [1]), TextDelta("b", [2]), TextDelta("c", [3], "stop")),
                             model=model, request_id="cmpl-2", prompt_tokens=2, clock=FakeClock(0.0, 0.5, 1.0))
    assert (await anext(stream)).token_ids == [1]
    await stream.aclose()
    span = spans.named("text_completion m-cancel")
    assert spans.is_error(span) and span.attributes["splitserve.outcome"] == "cancelled"
    assert sample("splitserve:requests_total", model_name=model, outcome="cancelled") == 1
    assert hist("splitserve:e2e_request_latency_seconds", model) == (0, 0)  # only finished requests
    assert sample("splitserve:num_requests_in_flight", model_name=model) == 0


async def test_request_closed_after_its_finish_delta_keeps_the_finish_reason(spans):
    stream = observe_request(deltas(TextDelta("a", [1]), TextDelta("b", [2], "stop"), TextDelta("never", [3])),
                             model="m-stop", request_id="cmpl-3", prompt_tokens=2)
    async for d in stream:
        if d.finish_reason:
            break
    await stream.aclose()  # what the HTTP app does after the last delta
    span = spans.named("text_completion m-stop")
    assert not spans.is_error(span) and span.attributes["splitserve.outcome"] == "stop"


async def test_request_error_is_recorded(spans):
    stream = observe_request(deltas(TextDelta("a", [1]), fail=WorkerUnavailable("decode worker gone")),
                             model="m-err", request_id="cmpl-4", prompt_tokens=2)
    with pytest.raises(WorkerUnavailable):
        async for _ in stream:
            pass
    span = spans.named("text_completion m-err")
    assert spans.is_error(span) and "decode worker gone" in span.status.description
    assert span.events and span.events[0].name == "exception"
    assert sample("splitserve:requests_total", model_name="m-err", outcome="error") == 1


def outputs(*token_lists, finish="length", forever=False):
    async def gen():
        for i, ids in enumerate(token_lists):
            yield SimpleNamespace(token_ids=ids, finish_reason=finish if i == len(token_lists) - 1 and not forever else None)
        if forever:
            await asyncio.Event().wait()
    return gen()


async def test_decode_queue_and_generate_spans(spans):
    queue0 = sample("splitserve:request_queue_time_seconds_count")
    with tracer().start_as_current_span("Decode") as parent:
        clock = FakeClock(10.0, 10.25, 10.5, 11.0)
        got = [o async for o in observe_decode(outputs([5], [6], [7]), "r1", clock=clock)]
    assert len(got) == 3
    queue, gen = spans.named("decode.queue"), spans.named("decode.generate")
    assert queue.parent.span_id == gen.parent.span_id == parent.get_span_context().span_id
    assert queue.end_time <= gen.start_time
    assert gen.attributes["gen_ai.usage.output_tokens"] == 3 and gen.attributes["splitserve.itl.max_s"] == 0.5
    assert sample("splitserve:request_queue_time_seconds_count") == queue0 + 1


async def test_decode_stream_cancelled_mid_generation(spans):
    cancelled0 = sample("splitserve:decode_requests_total", outcome="cancelled")

    async def consume():
        async for _ in observe_decode(outputs([5], [6], forever=True), "r2"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gen = spans.named("decode.generate")
    assert spans.is_error(gen) and gen.attributes["splitserve.outcome"] == "cancelled"
    assert sample("splitserve:decode_requests_total", outcome="cancelled") == cancelled0 + 1


async def test_prefill_span_and_prefix_cache_counters(spans):
    q0, h0 = sample("splitserve:prefix_cache_queries_total"), sample("splitserve:prefix_cache_hits_total")
    with observe_prefill("r3", 40) as obs:
        with tracer().start_as_current_span("engine"):
            pass
        obs.done(cached_tokens=32, finish_reason=None)
    with pytest.raises(RuntimeError):
        with observe_prefill("r4", 8):
            raise RuntimeError("forward failed")
    ok, failed = [s for s in spans.all() if s.name == "prefill"]
    assert spans.named("engine").parent.span_id == ok.context.span_id
    assert ok.attributes["gen_ai.usage.cache_read.input_tokens"] == 32 and not spans.is_error(ok)
    assert spans.is_error(failed)
    assert sample("splitserve:prefix_cache_queries_total") == q0 + 40
    assert sample("splitserve:prefix_cache_hits_total") == h0 + 32


LAYOUT = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


async def test_transfer_send_span_is_child_of_receive_span(spans):
    src, dst = allocate_kv_cache(LAYOUT, 8), allocate_kv_cache(LAYOUT, 8)
    sender, receiver = create_sender("inproc", src, LAYOUT), create_receiver("inproc", dst, LAYOUT)
    await sender.start()
    await receiver.start()
    sent0 = sample("splitserve:kv_transfer_bytes_total", direction="send", transport="inproc", path="host")
    received0 = sample("splitserve:kv_transfer_bytes_total", direction="receive", transport="inproc", path="host")
    try:
        sender.register("t1", [1, 2, 3], lambda tid, ok: None)
        with observe_receive("inproc", sender.endpoint, "t1", 3) as obs:
            obs.nbytes = await receiver.fetch(sender.endpoint, "t1", [1, 2, 3], [4, 5, 6], 5.0)
        with pytest.raises(TransferNotFound):
            with observe_receive("inproc", sender.endpoint, "gone", 1):
                await receiver.fetch(sender.endpoint, "gone", [1], [4], 5.0)
    finally:
        await receiver.close()
        await sender.close()
    nbytes = 3 * LAYOUT.block_nbytes
    received = [s for s in spans.all() if s.name == "kv.receive"]
    send = spans.named("kv.send")
    assert send.parent.span_id == received[0].context.span_id and send.kind is SpanKind.SERVER
    assert received[0].attributes["splitserve.kv.bytes"] == nbytes and received[0].attributes["splitserve.kv.gbps"] > 0
    assert send.attributes["splitserve.kv.blocks"] == 3
    assert spans.is_error(received[1]) and not spans.is_error(received[0])
    assert sample("splitserve:kv_transfer_bytes_total", direction="send", transport="inproc", path="host") == sent0 + nbytes
    assert sample("splitserve:kv_transfer_bytes_total", direction="receive", transport="inproc", path="host") == received0 + nbytes
    assert sample("splitserve:kv_transfers_total", direction="receive", transport="inproc", path="host", outcome="error") >= 1


async def test_trace_context_for_the_ucx_control_message(spans):
    with tracer().start_as_current_span("kv.receive") as span:
        value = current_trace_context()
    ctx = span.get_span_context()
    assert value.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")  # W3C traceparent, sampled flag set
    assert int(value[-2:], 16) & 1
    with tracer().start_as_current_span("kv.send", context=context_from(value)) as child:
        pass
    assert child.parent.span_id == ctx.span_id and child.get_span_context().trace_id == ctx.trace_id
    assert context_from("") is None and context_from("garbage") is None
    assert current_trace_context() == ""  # no current span


def test_no_trace_context_while_tracing_is_off():
    assert current_trace_context() == ""


async def test_store_op_span_and_counters(spans):
    hits0 = sample("splitserve:kv_store_lookups_total", result="hit")
    with observe_store_op("get", 4) as obs:
        obs.nbytes, obs.hits, obs.misses = 1024, 3, 1
    span = spans.named("kv_store.get")
    assert span.attributes["splitserve.kv_store.hits"] == 3 and not spans.is_error(span)
    assert sample("splitserve:kv_store_lookups_total", result="hit") == hits0 + 3
    assert sample("splitserve:kv_store_bytes_total", op="get") >= 1024
    with pytest.raises(ValueError, match="put"):
        with observe_store_op("delete", 1):
            pass
