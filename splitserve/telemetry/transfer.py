"""Spans and metrics of KV transfers (any transport).

Receiver (decode worker): :func:`observe_receive` around the pull -- span ``kv.receive``, current
inside the block so the transport can put its context into the control message it sends.
Sender (prefill worker): :func:`start_send` when a pull arrives, with the trace context that came in
that control message (see :mod:`splitserve.telemetry.propagation`), and
:meth:`TransferObservation.finish` when it is served -- span ``kv.send``, a child of the
receiver's ``kv.receive`` in the other process. A push (:mod:`splitserve.transfer.push`) sends the KV
layer group by layer group as the prefill computes it: :func:`observe_push_layers` makes each group's send a
``kv.push.layers`` span, a child of the push's ``kv.send`` (attributes ``splitserve.kv.first_layer``,
``.end_layer`` (exclusive), ``.blocks``, ``.bytes``, ``.transfer_id``).

Span attributes: ``splitserve.kv.transfer_id``, ``.transport``, ``.path``, ``.blocks``, ``.bytes``,
``.duration_s``, ``.gbps`` (decimal GB/s), ``server.address`` (receiver side: the sender's
data-plane endpoint). Metrics: ``splitserve:kv_transfer_seconds``, ``splitserve:kv_transfer_bytes_total``,
``splitserve:kv_transfers_total`` by direction, transport, path and outcome. ``path`` is how the bytes met this
side's KV cache: ``host``, ``cuda`` or ``staged`` (:mod:`splitserve.transfer.paths`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from splitserve.telemetry import metrics as m
from splitserve.telemetry.propagation import context_from
from splitserve.telemetry.spans import end_span, outcome_of
from splitserve.telemetry.tracing import tracer


class TransferObservation:
    """One transfer being measured. Set :attr:`nbytes` (receiver) or pass it to :meth:`finish`; :attr:`path` may be
    set until then."""

    def __init__(self, span, direction: str, transport: str, clock: Callable[[], float], path: str = "host") -> None:
        self.span = span
        self.direction = direction
        self.transport = transport
        self.path = path
        self.clock = clock
        self.start = clock()
        self.nbytes = 0
        self._finished = False

    def finish(self, ok: bool, nbytes: int | None = None, error: BaseException | str | None = None) -> None:
        """Record the transfer and end its span (once; later calls do nothing). ``error``: the
        exception, or a reason text when the transfer failed without one."""
        if self._finished:
            return
        self._finished = True
        if nbytes is not None:
            self.nbytes = nbytes
        seconds = self.clock() - self.start
        exc = error if isinstance(error, BaseException) else (RuntimeError(error) if error else None)
        outcome = "ok" if ok else outcome_of(exc or RuntimeError("transfer failed"), None)
        labels = (self.direction, self.transport, self.path)
        m.KV_TRANSFERS.labels(*labels, outcome).inc()
        attrs = {"splitserve.kv.duration_s": seconds, "splitserve.kv.path": self.path}
        if ok:
            m.KV_TRANSFER_TIME.labels(*labels).observe(seconds)
            m.KV_TRANSFER_BYTES.labels(*labels).inc(self.nbytes)
            attrs["splitserve.kv.bytes"] = self.nbytes
            if seconds > 0:
                attrs["splitserve.kv.gbps"] = self.nbytes / seconds / 1e9
        end_span(self.span, outcome, exc, **attrs)


def _attributes(transport: str, transfer_id: str, num_blocks: int) -> dict:
    return {"splitserve.kv.transfer_id": transfer_id, "splitserve.kv.transport": transport, "splitserve.kv.blocks": num_blocks}


@contextmanager
def observe_receive(transport: str, endpoint: str, transfer_id: str, num_blocks: int, clock: Callable[[], float] = time.perf_counter,
                    path: str = "host"):
    """Measure a pull; set ``obs.nbytes`` to the bytes received inside the block. An exception
    (or cancellation) leaving the block fails the transfer. ``path``: the receiver's KV path."""
    attrs = {**_attributes(transport, transfer_id, num_blocks), "server.address": endpoint}
    span = tracer().start_span("kv.receive", kind=SpanKind.CLIENT, attributes=attrs)
    obs = TransferObservation(span, "receive", transport, clock, path)
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield obs
    except BaseException as exc:
        obs.finish(False, error=exc)
        raise
    obs.finish(True)


@contextmanager
def observe_push_layers(send: TransferObservation, transfer_id: str, first_layer: int, end_layer: int, num_blocks: int):
    """Span ``kv.push.layers`` (a child of ``send``'s ``kv.send`` span) around posting layers ``[first_layer,
    end_layer)`` of ``num_blocks`` KV blocks; set ``obs.nbytes`` (bytes posted) inside the block. An exception
    leaving the block makes it an error span."""
    attrs = {**_attributes(send.transport, transfer_id, num_blocks), "splitserve.kv.first_layer": first_layer,
             "splitserve.kv.end_layer": end_layer}
    span = tracer().start_span("kv.push.layers", context=trace.set_span_in_context(send.span), attributes=attrs)
    obs = TransferObservation(span, "send", send.transport, send.clock, send.path)
    try:
        yield obs
    except BaseException as exc:
        end_span(span, outcome_of(exc, None), exc)
        raise
    end_span(span, "ok", **{"splitserve.kv.bytes": obs.nbytes})


def start_send(transport: str, transfer_id: str, num_blocks: int, trace_context: str = "",
               clock: Callable[[], float] = time.perf_counter, path: str = "host") -> TransferObservation:
    """Start measuring the serving of one pull; ``trace_context`` is the receiver's (may be ""); ``path``: the
    sender's KV path."""
    span = tracer().start_span("kv.send", context=context_from(trace_context), kind=SpanKind.SERVER,
                               attributes=_attributes(transport, transfer_id, num_blocks))
    return TransferObservation(span, "send", transport, clock, path)
