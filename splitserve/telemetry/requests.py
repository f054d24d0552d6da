"""The router's view of one request: a GenAI span and the latency metrics users watch.

:func:`observe_request` wraps the text-delta stream of one request (the generation pipeline's
output) and, without changing what flows through it:

* starts a span ``"{gen_ai.operation.name} {model}"`` (GenAI semantic conventions: model, sampling
  parameters, input/output/cached token counts, finish reason, time to first token, TPOT, an ITL
  summary) that is the parent of the backend's gRPC calls (prefill, decode), and ends it when the
  stream ends -- also when the client goes away (status ERROR, outcome ``cancelled``);
* records TTFT, ITL, TPOT, end-to-end latency, requests by outcome and token counts in
  :mod:`splitserve.telemetry.metrics`.

TTFT is measured from the first ``__anext__`` (the request reaching the backend, after
tokenization and validation) to the first delta carrying tokens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from splitserve.telemetry import metrics as m
from splitserve.telemetry.spans import end_span, latency_summary, outcome_of
from splitserve.telemetry.tracing import tracer

PROVIDER = "splitserve"


def operation_for(request_id: str) -> str:
    """GenAI operation name from the front end's request id (``chatcmpl-`` ids are chat)."""
    return "chat" if request_id.startswith("chatcmpl-") else "text_completion"


async def observe_request(
    deltas: AsyncIterator,
    *,
    model: str,
    request_id: str,
    prompt_tokens: int,
    params=None,
    stream: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AsyncIterator:
    """Yield every item of ``deltas`` (TextDelta-like: ``token_ids``, ``finish_reason``,
    ``cached_tokens``) while tracing and measuring the request; closing this generator closes
    ``deltas``. ``params`` is the request's SamplingParams (for span attributes)."""
    operation = operation_for(request_id)
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.response.id": request_id,
        "gen_ai.usage.input_tokens": prompt_tokens,
    }
    if stream is not None:
        attributes["gen_ai.request.stream"] = stream
    if params is not None:
        attributes.update({
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k,
        })
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
    span = tracer().start_span(f"{operation} {model}", attributes=attributes)
    ctx = trace.set_span_in_context(span) if span.is_recording() else None
    in_flight = m.REQUESTS_IN_FLIGHT.labels(model)
    itl = m.INTER_TOKEN_LATENCY.labels(model)
    in_flight.inc()
    start = clock()
    first = last = None
    gaps: list[float] = []
    num_out = cached = 0
    finish = None
    error: BaseException | None = None
    try:
        while True:
            token = otel_context.attach(ctx) if ctx is not None else None  # backend RPCs become children
            try:
                delta = await deltas.__anext__()
            except StopAsyncIteration:
                break
            finally:
                if token is not None:
                    otel_context.detach(token)
            if delta.token_ids:
                now = clock()
                if first is None:
                    first = now
                    m.TIME_TO_FIRST_TOKEN.labels(model).observe(now - start)
                else:
                    gaps.append(now - last)
                    itl.observe(now - last)
                last = now
                num_out += len(delta.token_ids)
            cached = max(cached, delta.cached_tokens)
            if delta.finish_reason is not None:
                finish = delta.finish_reason
            yield delta
    except BaseException as exc:
        error = exc
        raise
    finally:
        end = clock()
        in_flight.dec()
        token = otel_context.attach(ctx) if ctx is not None else None
        try:
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            if token is not None:
                otel_context.detach(token)
        outcome = outcome_of(error, finish)
        m.REQUESTS.labels(model, outcome).inc()
        m.PROMPT_TOKENS.labels(model).inc(prompt_tokens)
        m.GENERATION_TOKENS.labels(model).inc(num_out)
        if cached:
            m.PROMPT_TOKENS_CACHED.labels(model).inc(cached)
        tpot = (last - first) / (num_out - 1) if first is not None and num_out > 1 else None
        if finish is not None:
            m.E2E_LATENCY.labels(model).observe(end - start)
            if tpot is not None:
                m.TIME_PER_OUTPUT_TOKEN.labels(model).observe(tpot)
        ttft = first - start if first is not None else None
        end_span(
            span, outcome, error,
            **{
                "gen_ai.usage.output_tokens": num_out,
                "gen_ai.usage.cache_read.input_tokens": cached,
                "gen_ai.response.finish_reasons": [finish] if finish else None,
                "gen_ai.response.time_to_first_chunk": ttft,
                "gen_ai.server.time_to_first_token": ttft,
                "gen_ai.server.time_per_output_token": tpot,
                "splitserve.request_id": request_id,
                **latency_summary("splitserve.itl", gaps),
            },
        )
