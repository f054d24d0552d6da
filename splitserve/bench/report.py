"""Writing results: JSON (everything, per request), Markdown summary, comparison table, plots."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.bench.client import RequestRecord
from splitserve.bench.metrics import SLO, decoding_at_document_arrivals, summarize, summarize_by_kind
from splitserve.bench.plots import plot_cdf, plot_timeline
from splitserve.bench.workloads import Workload

# (row label, summary key, field; None field = a scalar key)
TABLE_ROWS = [
    ("TTFT mean (ms)", "ttft_ms", "mean"), ("TTFT p50 (ms)", "ttft_ms", "p50"), ("TTFT p90 (ms)", "ttft_ms", "p90"),
    ("TTFT p99 (ms)", "ttft_ms", "p99"),
    ("ITL mean (ms)", "itl_ms", "mean"), ("ITL p50 (ms)", "itl_ms", "p50"), ("ITL p90 (ms)", "itl_ms", "p90"),
    ("ITL p99 (ms)", "itl_ms", "p99"),
    ("TPOT mean (ms)", "tpot_ms", "mean"), ("TPOT p50 (ms)", "tpot_ms", "p50"), ("TPOT p90 (ms)", "tpot_ms", "p90"),
    ("TPOT p99 (ms)", "tpot_ms", "p99"),
    ("E2E p50 (ms)", "e2e_ms", "p50"), ("E2E p99 (ms)", "e2e_ms", "p99"),
    ("throughput (req/s)", "throughput_rps", None), ("output tokens/s", "output_tokens_per_s", None),
    ("goodput (req/s)", "goodput_rps", None), ("SLO attainment (%)", "slo_attainment", None),
    ("errors", "errors", None), ("duration (s)", "duration_s", None),
]


@dataclass
class RunResult:
    """One configuration's run of a workload."""

    config: str
    records: list[RequestRecord]
    duration_s: float
    slo: SLO
    meta: dict = field(default_factory=dict)

    @property
    def summary(self) -> dict:
        return summarize(self.records, self.duration_s, self.slo)

    def to_dict(self) -> dict:
        decoding = decoding_at_document_arrivals(self.records)
        return {
            "config": self.config, "meta": self.meta, "summary": self.summary,
            "by_kind": summarize_by_kind(self.records, self.duration_s, self.slo),
            "decoding_streams_at_document_arrival": decoding,
            "requests": [{**dataclasses.asdict(r), "tpot_s": r.tpot_s} for r in self.records],
        }


def _value(summary: dict, key: str, fld: str | None) -> float | None:
    v = summary[key] if fld is None else summary[key][fld]
    if v is not None and key == "slo_attainment":
        v *= 100
    return v


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return "-"
    return f"{a / b:.2f}×"


def comparison_table(results: list[RunResult]) -> str:
    """Markdown table: one column per configuration, then ratios of each to the first and, with
    three or more, of the last to the second."""
    sums = [r.summary for r in results]
    pairs = [(i, 0) for i in range(1, len(results))]
    if len(results) >= 3:
        pairs.append((len(results) - 1, 1))
    head = ["metric", *(r.config for r in results), *(f"{results[i].config} ÷ {results[j].config}" for i, j in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, fld in TABLE_ROWS:
        vals = [_value(s, key, fld) for s in sums]
        ratios = [_ratio(vals[i], vals[j]) if key not in ("errors", "duration_s") else "" for i, j in pairs]
        lines.append("| " + " | ".join([label, *(_fmt(v) for v in vals), *ratios]) + " |")
    return "\n".join(lines)


def workload_line(workload: Workload) -> str:
    keys = ("type", "requests", "seed", "input_scale", "output_scale", "time_scale", "block_tokens", "reused_block_fraction",
            "documents", "prompt_tokens", "output_tokens", "prompt_tokens_mean", "output_tokens_mean", "truncated_to_context")
    return ", ".join(f"{k}={workload.info[k]}" for k in keys if k in workload.info)


def write_results(out_dir: Path, workload: Workload, results: list[RunResult], header: dict, extra_md: str = "") -> dict[str, Path]:
    """Write ``results.json``, ``summary.md`` and the PNG plots into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "summary.md"}
    data = {"header": header, "workload": {"name": workload.name, **workload.info}, "runs": [r.to_dict() for r in results]}
    paths["json"].write_text(json.dumps(data, indent=1, default=str))
    paths["ttft_cdf"] = plot_cdf({r.config: [x.ttft_s * 1000 for x in r.records if x.ok] for r in results},
                                 f"TTFT CDF — {workload.name}", "TTFT (ms)", out_dir / "ttft_cdf.png")
    paths["itl_cdf"] = plot_cdf({r.config: [g * 1000 for x in r.records if x.ok for g in x.itl_s] for r in results},
                                f"ITL CDF — {workload.name}", "inter-token latency (ms)", out_dir / "itl_cdf.png")
    for r in results:
        paths[f"timeline_{r.config}"] = plot_timeline(r.records, f"{r.config} — {workload.name}", out_dir / f"timeline_{r.config}.png")
    md = [f"# splitserve bench — {workload.name}", "", f"Workload: {workload_line(workload)}", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += ["", comparison_table(results), ""]
    for r in results:
        decoding = decoding_at_document_arrivals(r.records)
        if decoding:
            md.append(f"- {r.config}: interactive streams decoding when each document arrived: min {min(decoding)}, "
                      f"median {sorted(decoding)[len(decoding) // 2]}, max {max(decoding)}")
    if extra_md:
        md += ["", extra_md]
    md += ["", "Plots: " + ", ".join(p.name for k, p in paths.items() if k not in ("json", "markdown")), ""]
    paths["markdown"].write_text("\n".join(md))
    return paths
