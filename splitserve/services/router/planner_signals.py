"""What the planner reads each tick (:class:`Signals`), from what the router already measures:

* TTFT and ITL: quantiles over the last ``window_s`` of the front doors' Prometheus histograms
  (``splitserve:time_to_first_token_seconds``, ``splitserve:inter_token_latency_seconds``), computed as PromQL's
  ``histogram_quantile(q, rate(..._bucket[window]))`` does: the difference of two cumulative bucket snapshots,
  interpolated linearly inside the bucket that holds the quantile (:class:`HistogramWindow`);
* queued prefill tokens (uncached prompt tokens sent and not yet prefilled) and running decodes (requests running
  or waiting on decode workers, or in flight from this router) from the worker registry;
* the workers that take each kind of work now.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from prometheus_client import Histogram

from splitserve.services.router.registry import DECODE, PREFILL, WorkerRegistry


def _cumulative(histogram: Histogram) -> dict[float, float]:
    """Cumulative bucket counts by upper bound (seconds; +Inf last), summed over every label set."""
    out: dict[float, float] = {}
    for metric in histogram.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return dict(sorted(out.items()))


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile (0..1) of a cumulative histogram ``{upper bound: count}`` (PromQL's histogram_quantile);
    None when it holds no observation. A quantile in the +Inf bucket is the largest finite bound."""
    bounds = list(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, count
    return lower


class HistogramWindow:
    """Quantiles of a Prometheus histogram over a sliding window of ``window_s`` seconds.

    :meth:`sample` (once per planner tick) snapshots its cumulative buckets; :meth:`quantile` compares the latest
    snapshot with the newest one at least ``window_s`` old (or the oldest kept). ``clock``: monotonic seconds.
    """

    def __init__(self, histogram: Histogram, window_s: float, clock: Callable[[], float]) -> None:
        self.histogram, self.window_s, self.clock = histogram, window_s, clock
        self._snapshots: deque[tuple[float, dict[float, float]]] = deque()

    def sample(self) -> None:
        now = self.clock()
        self._snapshots.append((now, _cumulative(self.histogram)))
        while len(self._snapshots) > 2 and self._snapshots[1][0] <= now - self.window_s:
            self._snapshots.popleft()

    def quantile(self, q: float) -> float | None:
        """Seconds; None when nothing was observed in the window."""
        if not self._snapshots:
            return None
        (_, old), (_, new) = self._snapshots[0], self._snapshots[-1]
        if len(self._snapshots) == 1:
            old = {}
        return bucket_quantile(q, {le: count - old.get(le, 0.0) for le, count in new.items()})


@dataclass(frozen=True, slots=True)
class Signals:
    """One tick's load. Latencies in seconds (None: no observation in the window)."""

    queued_prefill_tokens: float = 0.0  # summed over the workers that take prefill work
    running_decodes: float = 0.0  # summed over the workers that take decode work
    ttft_s: float | None = None
    itl_s: float | None = None


def registry_load(registry: WorkerRegistry) -> tuple[float, float]:
    """(queued prefill tokens, running decodes) over the workers in rotation for each kind of work."""
    queued = sum(w.queued_prefill_tokens for w in registry.up(PREFILL))
    running = sum(w.running_requests for w in registry.up(DECODE))
    return float(queued), float(running)
