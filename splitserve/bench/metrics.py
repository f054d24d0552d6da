"""Benchmark statistics: latency percentiles, throughput, goodput and SLO attainment.

Definitions (per run of ``duration_s`` seconds, from the first send to the last end):

* TTFT: send -> first text chunk. ITL: every gap between consecutive text chunks, pooled over
  requests. TPOT: per request, ``(e2e - TTFT) / (output_tokens - 1)``. E2E: send -> end of stream.
* throughput: completed requests / duration; output (input) token throughput likewise.
* a request *meets the SLO* when it succeeded, TTFT <= ``slo_ttft_ms`` and TPOT <= ``slo_tpot_ms``
  (an unset SLO always holds; a one-token request has no TPOT and meets that part).
* goodput: requests meeting the SLO / duration. attainment: their share of all requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitserve.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def distribution(values_ms: list[float]) -> dict:
    """``{count, mean, p50, p90, p99, max}`` (numpy linear-interpolated percentiles); None values when empty."""
    if not values_ms:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    a = np.asarray(values_ms, dtype=float)
    out = {"count": int(a.size), "mean": float(a.mean())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    out["max"] = float(a.max())
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict:
    """Summary of one run: latency distributions (ms), throughput, goodput, attainment, errors."""
    ok = [r for r in records if r.ok]
    good = [r for r in records if slo.met_by(r)]
    dur = duration_s if duration_s > 0 else float("nan")
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": duration_s,
        "ttft_ms": distribution([r.ttft_s * 1000 for r in ok]),
        "itl_ms": distribution([g * 1000 for r in ok for g in r.itl_s]),
        "tpot_ms": distribution([r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
        "e2e_ms": distribution([r.e2e_s * 1000 for r in ok]),
        "throughput_rps": len(ok) / dur,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / dur,
        "input_tokens_per_s": sum(r.prompt_tokens for r in ok) / dur,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "chunk_token_mismatch": sum(1 for r in ok if r.chunks != r.output_tokens),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "goodput_rps": len(good) / dur,
        "slo_attainment": len(good) / len(records) if records else 0.0,
    }


def summarize_by_kind(records: list[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict[str, dict]:
    """``summarize`` per request class (same duration, so rates are per-class shares of the run)."""
    kinds = sorted({r.kind for r in records})
    return {k: summarize([r for r in records if r.kind == k], duration_s, slo) for k in kinds}


def decoding_at_document_arrivals(records: list[RequestRecord]) -> list[int]:
    """For each "document" request: how many "interactive" requests were decoding when it was sent
    (first token received before, stream ended after)."""
    out = []
    inter = [r for r in records if r.kind == "interactive" and r.ok and r.end_s is not None]
    for d in records:
        if d.kind != "document":
            continue
        t = d.start_s
        out.append(sum(1 for r in inter if r.start_s + r.ttft_s <= t < r.end_s))
    return out
