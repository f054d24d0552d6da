"""Small helpers shared by the manual spans: outcomes, status, latency summaries."""

from __future__ import annotations

import asyncio
import statistics

from opentelemetry.trace import Span, Status, StatusCode

#: outcomes of a request or stream: finish reasons (stop, length, abort), "ok" for a finished unit of
#: work that has no finish reason (prefill, a transfer), "cancelled" and "error"
OUTCOMES = ("stop", "length", "abort", "ok", "cancelled", "error")


def outcome_of(exc: BaseException | None, finish_reason: str | None) -> str:
    """The outcome of a stream that ended with ``exc`` (None: it ended by itself) after having seen
    ``finish_reason`` (None: no finish reason yet)."""
    if finish_reason is not None:
        return finish_reason
    if exc is None:
        return "abort"  # ended without a finish reason
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return "error"


def end_span(span: Span, outcome: str, exc: BaseException | None = None, **attributes) -> None:
    """Set ``attributes`` and the status for ``outcome`` (ERROR for abort, cancelled, error), then end."""
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        span.set_attribute("splitserve.outcome", outcome)
        if outcome == "cancelled":
            span.set_status(Status(StatusCode.ERROR, "cancelled: the stream was closed before it finished"))
        elif outcome == "error":
            if exc is not None:
                span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}" if exc is not None else "error"))
        elif outcome == "abort":
            span.set_status(Status(StatusCode.ERROR, "aborted by the server"))
    span.end()


def latency_summary(prefix: str, gaps: list[float]) -> dict[str, float]:
    """Span attributes summarising inter-token gaps (seconds): mean, p50, p90, max; {} if none."""
    if not gaps:
        return {}
    ordered = sorted(gaps)
    return {
        f"{prefix}.mean_s": statistics.fmean(ordered),
        f"{prefix}.p50_s": ordered[len(ordered) // 2],
        f"{prefix}.p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        f"{prefix}.max_s": ordered[-1],
    }
