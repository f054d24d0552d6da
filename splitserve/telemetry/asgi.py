"""HTTP side of telemetry: ``GET /metrics`` for a Starlette app, and HTTP server spans.

:func:`instrument_app` wraps an ASGI app in ``opentelemetry-instrumentation-asgi``'s middleware:
one SERVER span per request that continues an incoming W3C ``traceparent`` header, without the
per-chunk send/receive spans (an SSE stream would otherwise make one span per token). ``/health``
and ``/metrics`` are not traced (override with ``OTEL_PYTHON_ASGI_EXCLUDED_URLS``).
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from splitserve.telemetry.metrics import expose
from splitserve.telemetry.tracing import tracing_enabled

DEFAULT_EXCLUDED_URLS = "/health$,/metrics$"


def metrics_route(*groups: str, registry: CollectorRegistry = REGISTRY, path: str = "/metrics") -> Route:
    """A Starlette route serving ``registry`` in the Prometheus text format, after exposing the
    metric ``groups`` on it (default: the front end's; see :func:`splitserve.telemetry.metrics.expose`)."""
    expose(*(groups or ("frontend",)), registry=registry)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Route(path, metrics, methods=["GET"])


def instrument_app(app):
    """``app`` wrapped for tracing, or ``app`` itself while tracing is off."""
    if not tracing_enabled():
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    excluded = os.environ.get("OTEL_PYTHON_ASGI_EXCLUDED_URLS") or os.environ.get("OTEL_PYTHON_EXCLUDED_URLS") or DEFAULT_EXCLUDED_URLS
    return OpenTelemetryMiddleware(app, excluded_urls=excluded, exclude_spans=["receive", "send"])
