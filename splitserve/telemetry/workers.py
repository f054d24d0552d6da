"""Spans and metrics of the prefill and decode workers.

Prefill: one ``prefill`` span per request (prompt tokens, cached tokens, first-token finish
reason), child of the ``PrefillService/Prefill`` server span; prefill time and prefix-cache
counters. Decode: two consecutive spans under the ``DecodeService/Decode`` server span:
``decode.queue`` (request handed to the engine until its first token: waiting for a batch slot
plus the first step) and ``decode.generate`` (first to last token: tokens, finish reason, ITL
summary); queue/decode time histograms, outcomes and tokens. Streams closed early (client gone)
end their spans with status ERROR, outcome ``cancelled``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from typing import Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from splitserve.telemetry import metrics as m
from splitserve.telemetry.spans import end_span, latency_summary, outcome_of
from splitserve.telemetry.tracing import tracer


class PrefillObservation:
    """Handed out by :func:`observe_prefill`; call :meth:`done` with the engine's output."""

    def __init__(self, span) -> None:
        self.span = span
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.ok = False

    def done(self, cached_tokens: int, finish_reason: str | None) -> None:
        self.cached_tokens = cached_tokens
        self.finish_reason = finish_reason
        self.ok = True


@contextmanager
def observe_prefill(request_id: str, prompt_tokens: int, clock: Callable[[], float] = time.perf_counter):
    """Span ``prefill`` (current inside the block) and prefill metrics for one request."""
    span = tracer().start_span("prefill", attributes={"splitserve.request_id": request_id, "gen_ai.usage.input_tokens": prompt_tokens})
    obs = PrefillObservation(span)
    start = clock()
    error = None
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield obs
    except BaseException as exc:
        error = exc
        raise
    finally:
        if obs.ok:
            m.PREFILL_TIME.observe(clock() - start)
            m.PREFIX_CACHE_QUERIES.inc(prompt_tokens)
            m.PREFIX_CACHE_HITS.inc(obs.cached_tokens)
        outcome = "ok" if obs.ok else outcome_of(error, None)
        end_span(span, outcome, error, **{
            "gen_ai.usage.cache_read.input_tokens": obs.cached_tokens,
            "splitserve.first_token_finish_reason": obs.finish_reason,
        })


async def observe_decode(
    outputs: AsyncIterator,
    request_id: str,
    *,
    local_prefill: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> AsyncIterator:
    """Yield the engine's outputs (``token_ids``, ``finish_reason``) for one decode request while
    recording the ``decode.queue`` and ``decode.generate`` spans and decode metrics. Closing this
    generator closes ``outputs``. Parent: the span current when iteration starts."""
    parent = otel_context.get_current()
    attrs = {"splitserve.request_id": request_id, "splitserve.local_prefill": local_prefill}
    start = clock()
    queue_span = tracer().start_span("decode.queue", context=parent, attributes=attrs)
    gen_span = None
    first = last = None
    gaps: list[float] = []
    num_tokens = 0
    finish = None
    error: BaseException | None = None
    try:
        async for out in outputs:
            now = clock()
            if first is None:
                first = now
                m.DECODE_QUEUE_TIME.observe(now - start)
                queue_span.end()
                gen_span = tracer().start_span("decode.generate", context=parent, attributes=attrs)
            else:
                gaps.append(now - last)
            last = now
            num_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                finish = out.finish_reason
            yield out
    except BaseException as exc:
        error = exc
        raise
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
        outcome = outcome_of(error, finish)
        m.DECODE_REQUESTS.labels(outcome).inc()
        m.DECODE_TOKENS.inc(num_tokens)
        if gen_span is None:
            end_span(queue_span, outcome, error)
        else:
            if finish is not None:
                m.DECODE_TIME.observe(last - first)
            end_span(gen_span, outcome, error, **{
                "gen_ai.usage.output_tokens": num_tokens,
                "gen_ai.response.finish_reasons": [finish] if finish else None,
                **latency_summary("splitserve.itl", gaps),
            })
