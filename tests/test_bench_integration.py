"""`splitserve bench` against a real router + prefill + decode cluster (a handful of requests; no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.paths import default_model_path


@pytest.mark.slow
@pytest.mark.integration
def test_bench_cli_against_real_cluster(cluster, tmp_path):
    base_url, _, _ = cluster
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--url", base_url, "--model", str(default_model_path()),
           "--workload", "fixed", "--prompt-tokens", "20", "--output-tokens", "6", "--num-requests", "4",
           "--arrival", "poisson", "--rate", "20", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
           "--out", str(out), "--no-progress", "--label", "disaggregated"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "results.json").read_text())
    run = data["runs"][0]
    s = run["summary"]
    assert run["config"] == "disaggregated" and s["requests"] == 4 and s["completed"] == 4 and s["errors"] == 0
    assert s["output_tokens"] == 24 and s["prompt_tokens"] == 80  # ignore_eos: exactly max_tokens each
    assert s["slo_attainment"] == 1.0 and s["ttft_ms"]["count"] == 4
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in run["requests"])
    assert (out / "summary.md").read_text().startswith("# splitserve bench") and (out / "itl_cdf.png").stat().st_size > 0
    assert "ITL p99 (ms)" in proc.stdout
