"""Trace context across the UCX handoff: W3C ``traceparent`` (and ``tracestate``) in one string.

The decode worker's KV receiver puts :func:`current_trace_context` into its FETCH control message;
the prefill worker's sender starts its send span under :func:`context_from` of that string, so the
transfer spans of both processes join the request's trace.

Format: ``"<traceparent>"`` or ``"<traceparent>\\n<tracestate>"`` (ASCII, at most
:data:`MAX_TRACE_CONTEXT_BYTES`); ``""`` when there is no sampled span or tracing is off.
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from splitserve.telemetry.tracing import tracing_enabled

MAX_TRACE_CONTEXT_BYTES = 512
_w3c = TraceContextTextMapPropagator()


def current_trace_context() -> str:
    """The current span's context as a string for a control message ("" if none or tracing is off)."""
    if not tracing_enabled():
        return ""
    carrier: dict[str, str] = {}
    _w3c.inject(carrier)
    parent = carrier.get("traceparent", "")
    if not parent:
        return ""
    state = carrier.get("tracestate", "")
    out = f"{parent}\n{state}" if state else parent
    return out if len(out) <= MAX_TRACE_CONTEXT_BYTES else parent


def context_from(value: str) -> Context | None:
    """The remote parent carried by ``value`` (None if empty or malformed: a new trace starts)."""
    if not value:
        return None
    parent, _, state = value.partition("\n")
    carrier = {"traceparent": parent}
    if state:
        carrier["tracestate"] = state
    ctx = _w3c.extract(carrier)
    return ctx or None
