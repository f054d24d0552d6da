"""Spans and metrics for the KV-cache store (``splitserve/services/kvstore``) and its clients.

Use :func:`observe_store_op` around a put or get of KV blocks (span ``kv_store.put`` /
``kv_store.get``: keys, bytes, hit/miss counts), :func:`record_lookup` for every block looked up,
and :func:`record_evictions` when the store evicts objects.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from splitserve.telemetry import metrics as m
from splitserve.telemetry.spans import end_span, outcome_of
from splitserve.telemetry.tracing import tracer

OPS = ("put", "get")


class StoreObservation:
    """Handed out by :func:`observe_store_op`: set ``nbytes``, ``hits`` and ``misses`` as known."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.hits = 0
        self.misses = 0


@contextmanager
def observe_store_op(op: str, num_keys: int, clock: Callable[[], float] = time.perf_counter, **attributes):
    """Span ``kv_store.<op>`` (current inside the block) and store metrics for one put or get.

    Raises:
        ValueError: ``op`` is not ``put`` or ``get``.
    """
    if op not in OPS:
        raise ValueError(f"store op must be one of {OPS}, got {op!r}")
    span = tracer().start_span(f"kv_store.{op}", kind=SpanKind.CLIENT, attributes={"splitserve.kv_store.keys": num_keys, **attributes})
    obs = StoreObservation()
    start = clock()
    error = None
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield obs
    except BaseException as exc:
        error = exc
        raise
    finally:
        if error is None:
            m.STORE_OP_TIME.labels(op).observe(clock() - start)
            m.STORE_BYTES.labels(op).inc(obs.nbytes)
        if obs.hits or obs.misses:
            record_lookup(obs.hits, obs.misses)
        end_span(span, "ok" if error is None else outcome_of(error, None), error, **{
            "splitserve.kv_store.bytes": obs.nbytes,
            "splitserve.kv_store.hits": obs.hits,
            "splitserve.kv_store.misses": obs.misses,
        })


def record_lookup(hits: int, misses: int) -> None:
    """Count block lookups: ``hits`` found, ``misses`` not found."""
    m.STORE_LOOKUPS.labels("hit").inc(hits)
    m.STORE_LOOKUPS.labels("miss").inc(misses)


def record_evictions(count: int) -> None:
    m.STORE_EVICTIONS.inc(count)
