"""Benchmark statistics: percentiles, TPOT, goodput and attainment, decoding-stream counts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitserve.bench.client import RequestRecord
from splitserve.bench.metrics import SLO, decoding_at_document_arrivals, distribution, summarize, summarize_by_kind


def rec(i, ttft, itl, out, *, start=0.0, kind="interactive", error=None, prompt=10):
    e2e = None if ttft is None else ttft + sum(itl)
    return RequestRecord(i, kind, out, start_s=start, ttft_s=ttft, itl_s=list(itl), e2e_s=e2e, prompt_tokens=prompt,
                         output_tokens=out, chunks=len(itl) + (ttft is not None), error=error)


def test_distribution_matches_numpy_linear_percentiles():
    values = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0]
    d = distribution(values)
    assert d["count"] == 6 and d["mean"] == pytest.approx(np.mean(values)) and d["max"] == 100.0
    for p in (50, 90, 99):
        assert d[f"p{p}"] == pytest.approx(np.percentile(values, p))
    assert d["p50"] == pytest.approx(3.5)  # linear interpolation between 3 and 4
    assert distribution([])["p99"] is None and distribution([])["count"] == 0


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = rec(0, 0.5, [0.1, 0.2, 0.3], 4)  # e2e = 1.1 s
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert rec(1, 0.5, [], 1).tpot_s is None  # one token: no TPOT
    assert rec(2, None, [], 0, error="HTTP 500").tpot_s is None


def test_goodput_and_attainment_need_both_slos():
    records = [
        rec(0, 0.10, [0.02] * 9, 10),  # meets both
        rec(1, 0.90, [0.02] * 9, 10),  # TTFT too slow
        rec(2, 0.10, [0.20] * 9, 10),  # TPOT too slow
        rec(3, 0.10, [], 1),  # one token: TPOT part holds
        rec(4, None, [], 0, error="HTTP 503: busy"),  # failed: never good
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=500, tpot_ms=50))
    assert s["requests"] == 5 and s["completed"] == 4 and s["errors"] == 1
    assert s["goodput_rps"] == pytest.approx(2 / 2.0) and s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["throughput_rps"] == pytest.approx(4 / 2.0) and s["output_tokens_per_s"] == pytest.approx(31 / 2.0)
    assert s["itl_ms"]["count"] == 27 and s["tpot_ms"]["count"] == 3
    assert s["ttft_ms"]["max"] == pytest.approx(900)
    no_slo = summarize(records, 2.0)
    assert no_slo["goodput_rps"] == pytest.approx(no_slo["throughput_rps"])


def test_by_kind_and_decoding_streams_at_document_arrival():
    records = [
        rec(0, 0.1, [0.1] * 20, 21, start=0.0),  # decoding from 0.1 to 2.1
        rec(1, 0.1, [0.1] * 5, 6, start=0.5),  # decoding from 0.6 to 1.1
        rec(2, 0.2, [0.1], 2, start=1.0, kind="document", prompt=1000),  # both decoding at t=1.0
        rec(3, 0.2, [0.1], 2, start=3.0, kind="document", prompt=1000),  # none at t=3.0
    ]
    assert decoding_at_document_arrivals(records) == [2, 0]
    by = summarize_by_kind(records, 4.0)
    assert set(by) == {"document", "interactive"} and by["document"]["prompt_tokens"] == 2000
    assert not math.isnan(by["interactive"]["throughput_rps"])
