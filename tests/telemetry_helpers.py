"""Shared by the telemetry tests: an in-memory tracer provider installed for splitserve's spans."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import REGISTRY

from splitserve.telemetry import metrics, tracing

metrics.expose(*metrics.GROUPS)  # the tests read every group from the default registry


class Spans:
    """Finished spans of a test, looked up by name."""

    def __init__(self, monkeypatch) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        monkeypatch.setattr(tracing, "_provider", self.provider)
        monkeypatch.setattr(tracing, "_tracer", self.provider.get_tracer("splitserve"))

    def all(self):
        return list(self.exporter.get_finished_spans())

    def named(self, name: str):
        found = [s for s in self.all() if s.name == name]
        assert len(found) == 1, f"{name}: {len(found)} spans; have {[s.name for s in self.all()]}"
        return found[0]

    @staticmethod
    def is_error(span) -> bool:
        return span.status.status_code is StatusCode.ERROR


def sample(name: str, **labels) -> float:
    """Current value of one Prometheus sample in the default registry (0 if absent)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


class FakeClock:
    """Returns the next of ``times`` at each call (then keeps the last)."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]
