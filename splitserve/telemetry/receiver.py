"""An OTLP/gRPC trace receiver that keeps spans in memory (for tests and benchmarks).

Built on ``opentelemetry-proto``'s collector service (``TraceService.Export``); real processes
export to it with the standard OTLP exporter (``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.endpoint>``).
It runs on its own thread pool, independent of any event loop.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

STATUS_UNSET, STATUS_OK, STATUS_ERROR = (trace_pb2.Status.STATUS_CODE_UNSET, trace_pb2.Status.STATUS_CODE_OK,
                                          trace_pb2.Status.STATUS_CODE_ERROR)


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span. Ids are lowercase hex ("" for a root span's parent)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (SERVER = 2, CLIENT = 3, INTERNAL = 1)
    status_code: int  # STATUS_UNSET / STATUS_OK / STATUS_ERROR
    status_message: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)


def _value(v: common_pb2.AnyValue):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex(), kind=s.kind, status_code=s.status.code,
                    status_message=s.status.message, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes={kv.key: _value(kv.value) for kv in s.attributes},
                ))
    return out


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``with OTLPReceiver() as r:`` -- listens on ``r.endpoint`` (``http://host:port``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._cond = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"OTLP receiver cannot bind {host}:{port}")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "OTLPReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def Export(self, request, context):  # gRPC method name
        spans = _spans(request)
        with self._cond:
            self._spans.extend(spans)
            self.requests += 1
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Block until ``predicate(all spans so far)`` is true; returns the spans.

        Raises:
            TimeoutError: not true within ``timeout_s`` (the message lists the span names seen).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self._spans), timeout=timeout_s):
                names = sorted({f"{s.service}:{s.name}" for s in self._spans})
                raise TimeoutError(f"spans not received within {timeout_s} s; have {len(self._spans)}: {names}")
            return list(self._spans)
