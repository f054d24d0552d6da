"""Tracer provider set-up from the standard OpenTelemetry environment variables.

Read here: ``OTEL_SDK_DISABLED`` (``true`` = no tracing at all), ``OTEL_TRACES_EXPORTER``
(comma-separated ``otlp``, ``console``, ``none``; default ``otlp`` when an OTLP endpoint is
set, else ``none``), ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
(``grpc``, the default, or ``http/protobuf``), ``OTEL_SERVICE_NAME`` (default: the name the
process passes, e.g. ``splitserve-decode``).

Read by the SDK itself: ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` / ``_HEADERS`` / ``_TIMEOUT`` /
``_INSECURE``, ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` (default
``parentbased_always_on``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*`` (batching).

Unlike the SDK's own default, an unset endpoint does not mean "export to localhost:4317": a
process without tracing configuration installs nothing, so tracing costs nothing.
"""

from __future__ import annotations

import logging
import os
import socket

from opentelemetry import trace

logger = logging.getLogger(__name__)

TRACER_NAME = "splitserve"
_EXPORTERS = ("otlp", "console", "none")
_PROTOCOLS = ("grpc", "http/protobuf")

_provider = None  # the SDK TracerProvider once set up


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def sdk_disabled() -> bool:
    return _env("OTEL_SDK_DISABLED").lower() == "true"


def exporter_names() -> list[str]:
    """The exporters to use, from ``OTEL_TRACES_EXPORTER`` (see the module docstring).

    Raises:
        ValueError: an unknown exporter name.
    """
    raw = _env("OTEL_TRACES_EXPORTER")
    if not raw:
        has_endpoint = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if has_endpoint else []
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    bad = [n for n in names if n not in _EXPORTERS]
    if bad:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter(s) {bad}; supported: {', '.join(_EXPORTERS)}")
    return [n for n in names if n != "none"]


def otlp_protocol() -> str:
    """``grpc`` or ``http/protobuf``. Raises ValueError on anything else."""
    proto = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").lower()
    if proto not in _PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={proto!r}: supported are {', '.join(_PROTOCOLS)}")
    return proto


def _exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()  # endpoint, headers, timeout, TLS: from OTEL_EXPORTER_OTLP_* (SDK)


def _resource(default_service_name: str):
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource

    resource = Resource.create({})  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, SDK attributes
    ours = {}
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        ours[SERVICE_NAME] = default_service_name
    if SERVICE_INSTANCE_ID not in resource.attributes:
        ours[SERVICE_INSTANCE_ID] = f"{socket.gethostname()}:{os.getpid()}"
    return resource.merge(Resource(ours))


def setup_tracing(default_service_name: str):
    """Install the process's tracer provider as configured by the environment.

    Call once, early in ``main`` (before any gRPC server or channel is created). Returns the SDK
    ``TracerProvider``, or None when tracing is off (``OTEL_SDK_DISABLED=true`` or no exporter).
    A second call returns the first provider. Spans still buffered are exported when the process
    exits normally (the SDK flushes at interpreter exit).

    Raises:
        ValueError: unsupported ``OTEL_TRACES_EXPORTER`` or ``OTEL_EXPORTER_OTLP_PROTOCOL``.
    """
    global _provider
    if _provider is not None:
        return _provider
    if sdk_disabled():
        return None
    names = exporter_names()
    if not names:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=_resource(default_service_name))  # sampler: OTEL_TRACES_SAMPLER
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    _provider = provider
    logger.info("tracing on: exporters %s, service %s", ",".join(names), provider.resource.attributes.get("service.name"))
    return provider


def tracing_enabled() -> bool:
    """True once :func:`setup_tracing` installed a provider in this process."""
    return _provider is not None


_tracer = trace.get_tracer(TRACER_NAME)  # a proxy: follows the provider once one is set


def tracer() -> trace.Tracer:
    """splitserve's tracer (its spans are no-op spans while tracing is off)."""
    return _tracer
