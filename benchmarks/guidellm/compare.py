"""Side-by-side of `splitserve bench` results.json files and a guidellm JSON report (same workload shape).

Matching definitions: TTFT is TTFT in both; guidellm's "inter_token_latency_ms" is per request
(last token - first token) / (output tokens - 1), which is our TPOT; guidellm's
"time_per_output_token_ms" includes the first token (latency / output tokens), reported here too.
Our per-request values are recomputed from results.json with numpy's linear percentiles.

Usage: python benchmarks/guidellm/compare.py guidellm.json RESULTS.json [RESULTS.json ...]
"""

from __future__ import annotations

import json
import sys

import numpy as np

ROWS = [("TTFT", "ttft"), ("TPOT = guidellm ITL", "tpot"), ("latency / output tokens = guidellm TPOT", "tpot_incl"),
        ("request latency (ms)", "e2e")]
STATS = ("mean", "p50", "p90", "p95", "p99")
GUIDELLM = {"ttft": "time_to_first_token_ms", "tpot": "inter_token_latency_ms", "tpot_incl": "time_per_output_token_ms",
            "e2e": "request_latency"}


def ours(path: str) -> tuple[str, dict[str, dict[str, float]], float]:
    run = json.load(open(path))["runs"][0]
    reqs = [r for r in run["requests"] if r["error"] is None]
    values = {
        "ttft": [r["ttft_s"] * 1000 for r in reqs],
        "tpot": [r["tpot_s"] * 1000 for r in reqs if r["tpot_s"] is not None],
        "tpot_incl": [r["e2e_s"] * 1000 / r["output_tokens"] for r in reqs],
        "e2e": [r["e2e_s"] * 1000 for r in reqs],
    }
    out = {k: {"mean": float(np.mean(v)), **{f"p{p}": float(np.percentile(v, p)) for p in (50, 90, 95, 99)}} for k, v in values.items()}
    return run["config"], out, run["summary"]["output_tokens_per_s"]


def guidellm(path: str) -> tuple[dict[str, dict[str, float]], float]:
    m = json.load(open(path))["benchmarks"][0]["metrics"]
    out = {}
    for key, name in GUIDELLM.items():
        s = m[name]["successful"]
        scale = 1000.0 if key == "e2e" else 1.0  # request_latency is in seconds
        out[key] = {"mean": s["mean"] * scale, **{p: s["percentiles"][p] * scale for p in ("p50", "p90", "p95", "p99")}}
    return out, m["output_tokens_per_second"]["successful"]["mean"]


def main() -> None:
    g, g_tps = guidellm(sys.argv[1])
    runs = [ours(p) for p in sys.argv[2:]]
    head = ["metric (ms)", "guidellm", *(name for name, _, _ in runs), *(f"{name} ÷ guidellm" for name, _, _ in runs)]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for label, key in ROWS:
        for stat in STATS:
            gv = g[key][stat]
            vals = [r[key][stat] for _, r, _ in runs]
            print(f"| {label} {stat} | {gv:.1f} | " + " | ".join(f"{v:.1f}" for v in vals) + " | "
                  + " | ".join(f"{v / gv:.2f}×" for v in vals) + " |")
    print(f"| output tokens/s | {g_tps:.1f} | " + " | ".join(f"{t:.1f}" for _, _, t in runs) + " | "
          + " | ".join(f"{t / g_tps:.2f}×" for _, _, t in runs) + " |")


if __name__ == "__main__":
    main()
