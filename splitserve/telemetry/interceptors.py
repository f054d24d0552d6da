"""gRPC aio interceptors: W3C trace context on every hop, one span per RPC on each side.

Built on ``opentelemetry-instrumentation-grpc`` (its ``aio_server_interceptor`` /
``aio_client_interceptors``), with fixes for long-lived streams on both sides:

* server: a handler cancelled by its client (``CancelledError``, or the response generator closed)
  ends its span with ``rpc.grpc.status_code`` 1 and a ``cancelled`` event (status not ERROR, per the
  gRPC conventions -- a client may cancel after it got everything it wanted; the spans of the work
  cut short carry the error); an unexpected exception sets ERROR (the library only records it);
  the span is current only while the servicer runs, never across a ``yield``; the servicer's
  response generator is always closed.
* client, unary-unary and unary-stream: the span ends when the call terminates, whatever the way
  (done callback), so a cancelled call or a stream abandoned by its reader is still ended and
  exported. The library leaves the span open when a unary call is cancelled, and ends a stream's
  span only when the stream's iterator is garbage collected. Client spans of calls cancelled by
  this process carry ``rpc.grpc.status_code`` 1 but no ERROR status: the caller chose to stop.

Health checks (``grpc.health.v1.Health``) and ``GetStats`` calls (the router's once-a-second worker
polls; they were 84% of exported spans) are never traced, nor are services listed in
``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES``. Both functions return ``[]`` while tracing is off.
"""

from __future__ import annotations

import asyncio
import os

import grpc
from opentelemetry.context import attach, detach
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.instrumentation.grpc._aio_client import (
    UnaryStreamAioClientInterceptor,
    UnaryUnaryAioClientInterceptor,
)
from opentelemetry.instrumentation.grpc._aio_server import (
    OpenTelemetryAioServerInterceptor,
    _OpenTelemetryAioServicerContext,
)
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.propagate import extract
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from splitserve.telemetry.tracing import tracing_enabled

RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
#: the stats RPC every worker and store service answers; polled by the router, never traced
POLL_METHOD = "GetStats"

#: ``with untraced(): ...`` -- calls made inside (and in tasks created inside) get no RPC/HTTP spans
untraced = suppress_instrumentation


def _filter():
    """Trace everything except health checks, ``GetStats`` polls and ``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES``."""
    excluded = [filters.health_check(), filters.method_name(POLL_METHOD)]
    excluded += [filters.service_name(s.strip()) for s in os.environ.get("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "").split(",") if s.strip()]
    return filters.negate(filters.any_of(*excluded))


def server_interceptors(tracer_provider=None) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for ``grpc.aio.server(interceptors=...)``; ``[]`` while tracing is off (unless a
    ``tracer_provider`` is given: then its tracer is used instead of the global one)."""
    if tracer_provider is None and not tracing_enabled():
        return []
    base = aio_server_interceptor(tracer_provider=tracer_provider, filter_=_filter())
    return [_ServerInterceptor(base._tracer, filter_=base._filter)]  # same tracer and filter


def client_interceptors(tracer_provider=None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.insecure_channel(interceptors=...)``; ``[]`` while tracing is off
    (unless a ``tracer_provider`` is given, as for :func:`server_interceptors`)."""
    if tracer_provider is None and not tracing_enabled():
        return []
    filter_ = _filter()
    library = aio_client_interceptors(tracer_provider=tracer_provider, filter_=filter_)
    tracer = library[0]._tracer  # the instrumentation's own tracer (name, version, schema)
    streaming_requests = [i for i in library if not isinstance(i, (UnaryUnaryAioClientInterceptor, UnaryStreamAioClientInterceptor))]
    return [_UnaryUnaryClient(tracer, filter_=filter_), _UnaryStreamClient(tracer, filter_=filter_), *streaming_requests]


# ---------------------------------------------------------------------------------------------- server


def _set_unexpected_error(span: Span, error: BaseException) -> None:
    span.record_exception(error)
    if span.is_recording() and getattr(span, "status", None) is not None and span.status.status_code is StatusCode.UNSET:
        span.set_attribute(RPC_GRPC_STATUS_CODE, grpc.StatusCode.UNKNOWN.value[0])
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


def _set_cancelled(span: Span) -> None:
    # Not an ERROR status (the gRPC semantic conventions: a server span errs only on server faults);
    # the spans of the work that was cut short (decode.generate, prefill) carry the error.
    span.set_attribute(RPC_GRPC_STATUS_CODE, grpc.StatusCode.CANCELLED.value[0])
    span.add_event("cancelled", {"reason": "the client cancelled the call"})


class _ServerInterceptor(OpenTelemetryAioServerInterceptor):
    def _intercept_aio_server_unary(self, behavior, handler_call_details):
        async def _unary(request_or_iterator, context):
            with self._set_remote_context(context):
                with self._start_span(handler_call_details, context, set_status_on_exception=False) as span:
                    context = _OpenTelemetryAioServicerContext(context, span)
                    try:
                        return await behavior(request_or_iterator, context)
                    except asyncio.CancelledError:
                        _set_cancelled(span)
                        raise
                    except Exception as error:
                        if type(error) is not Exception:  # a bare Exception is an abort (status already set)
                            _set_unexpected_error(span, error)
                        raise

        return _unary

    def _intercept_aio_server_stream(self, behavior, handler_call_details):
        # The span is current only while the servicer runs (inside each __anext__), never across a
        # yield: a stream abandoned by grpc is finalized on another task, where a context attached
        # here could not be detached.
        async def _stream(request_or_iterator, context):
            metadata = context.invocation_metadata()
            parent = extract({md.key: md.value for md in metadata}) if metadata else None
            span = self._tracer.start_span(handler_call_details.method, context=parent, kind=SpanKind.SERVER,
                                           attributes=_server_attributes(handler_call_details, context))
            current = set_span_in_context(span, parent)
            responses = behavior(request_or_iterator, _OpenTelemetryAioServicerContext(context, span))
            try:
                while True:
                    token = attach(current)
                    try:
                        response = await responses.__anext__()
                    except StopAsyncIteration:
                        break
                    finally:
                        detach(token)
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                _set_cancelled(span)
                raise
            except Exception as error:
                if type(error) is not Exception:  # a bare Exception is an abort (status already set)
                    _set_unexpected_error(span, error)
                raise
            finally:
                try:
                    await responses.aclose()
                finally:
                    span.end()

        return _stream


def _server_attributes(handler_call_details, context) -> dict:
    """What the library's server span carries: rpc.system/service/method and the peer."""
    service, _, method = handler_call_details.method.lstrip("/").partition("/")
    attrs = {"rpc.system": "grpc", RPC_GRPC_STATUS_CODE: grpc.StatusCode.OK.value[0], "rpc.service": service, "rpc.method": method}
    peer = context.peer() or ""
    if peer.startswith(("ipv4:", "ipv6:")):
        ip, _, port = peer.split(",")[0].split(":", 1)[1].rpartition(":")
        attrs.update({"net.peer.ip": ip.strip("[]"), "net.peer.port": port})
    return attrs


# ---------------------------------------------------------------------------------------------- client

_pending: set[asyncio.Task] = set()  # keeps span-ending tasks alive until they ran


async def _end_when_done(span: Span, call) -> None:
    try:
        code = await call.code()
        details = await call.details()
    except BaseException as exc:  # the span must end whatever happens
        span.record_exception(exc)
        code, details = grpc.StatusCode.UNKNOWN, repr(exc)
    span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
    span.end()


def _end_on_done(span: Span, call) -> None:
    def callback(_call) -> None:
        task = asyncio.ensure_future(_end_when_done(span, call))
        _pending.add(task)
        task.add_done_callback(_pending.discard)

    try:
        call.add_done_callback(callback)
    except NotImplementedError:  # pragma: no cover - call types without callbacks
        callback(call)


class _ClientMixin:
    async def _traced_call(self, continuation, client_call_details, request):
        if self.tracing_skipped(client_call_details):
            return await continuation(client_call_details, request)
        with self._start_interceptor_span(client_call_details.method) as span:  # not ended on exit
            details = self.propagate_trace_in_details(client_call_details)
            if self._request_hook:
                self._call_request_hook(span, request)
            try:
                call = await continuation(details, request)
            except BaseException as exc:
                self.add_error_details_to_span(span, exc)
                span.end()
                raise
        _end_on_done(span, call)
        return call


class _UnaryUnaryClient(_ClientMixin, UnaryUnaryAioClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._traced_call(continuation, client_call_details, request)


class _UnaryStreamClient(_ClientMixin, UnaryStreamAioClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._traced_call(continuation, client_call_details, request)
