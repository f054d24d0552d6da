"""KV push counters (the workers' GetStats ``kv_push*`` keys) on /metrics (splitserve.telemetry.push_metrics)."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest

from splitserve.telemetry.push_metrics import push_counters, register_push_stats


def test_push_counters_of_both_roles_are_exposed_under_splitserve_names() -> None:
    prefill = {"requests": 9, "kv_pushes": 3, "kv_push_fallbacks": 1, "kv_pushes_pending": 2, "kv_bytes_sent": 7}
    decode = {"requests": 4, "kv_pushes_received": 3, "kv_bytes_received": 5}
    assert push_counters(prefill) == {"pushes": 3, "push_fallbacks": 1, "pushes_pending": 2}
    registry = CollectorRegistry()
    register_push_stats(lambda: prefill, lambda: decode, registry=registry)
    text = generate_latest(registry).decode()
    lines = {line for line in text.splitlines() if not line.startswith("#")}
    assert lines == {"splitserve:kv_pushes_total 3.0", "splitserve:kv_push_fallbacks_total 1.0",
                     "splitserve:kv_pushes_pending 2.0", "splitserve:kv_pushes_received_total 3.0"}
    assert "# TYPE splitserve:kv_pushes_pending gauge" in text
    assert re.search(r"^# TYPE splitserve:kv_pushes(_total)? counter$", text, re.M)
    prefill["kv_pushes"] = 4  # read at scrape time
    assert "splitserve:kv_pushes_total 4.0" in generate_latest(registry).decode()
