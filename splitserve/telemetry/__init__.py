"""Telemetry shared by every splitserve process: OpenTelemetry traces and Prometheus metrics.

Modules (each with one job):

* :mod:`~splitserve.telemetry.tracing` -- tracer provider from the standard ``OTEL_*`` variables.
* :mod:`~splitserve.telemetry.interceptors` -- gRPC aio interceptors (W3C context on every hop,
  health checks not traced, streaming spans ended on cancel).
* :mod:`~splitserve.telemetry.asgi` -- HTTP server spans (incoming ``traceparent``) and ``GET /metrics``.
* :mod:`~splitserve.telemetry.propagation` -- trace context in the UCX control message.
* :mod:`~splitserve.telemetry.requests` -- the router's request span (GenAI conventions), TTFT/ITL/TPOT.
* :mod:`~splitserve.telemetry.workers` -- prefill and decode spans and metrics.
* :mod:`~splitserve.telemetry.transfer` -- KV transfer send/receive spans and metrics.
* :mod:`~splitserve.telemetry.store` -- KV store put/get spans and hit/eviction metrics.
* :mod:`~splitserve.telemetry.spans` -- outcome/status helpers shared by the manual spans.
* :mod:`~splitserve.telemetry.metrics` -- every Prometheus metric (``splitserve:`` prefix), by role.
* :mod:`~splitserve.telemetry.exposition` -- the workers' ``/metrics`` HTTP server and engine gauges.
* :mod:`~splitserve.telemetry.receiver` -- an OTLP/gRPC trace receiver (tests, benchmarks).

With tracing not configured (or ``OTEL_SDK_DISABLED=true``) no interceptor or middleware is
installed and manual spans are OpenTelemetry's no-op spans.
"""
