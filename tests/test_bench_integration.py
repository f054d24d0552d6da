"""`splitserve bench` against a real router + prefill + decode cluster (a handful of requests; no timing asserts)."""

from __future__ import annotations

import json
import os
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


@pytest.mark.slow
@pytest.mark.integration
def test_bench_defaults_to_the_served_model_and_fits_its_context(cluster, tmp_path):
    """No --model: the endpoint's model (GET /v1/models) builds the prompts; the mixed workload's long
    documents are cut to the model's context, so every request succeeds."""
    base_url, _, _ = cluster
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--url", base_url, "--num-requests", "9", "--document-every", "1",
           "--interactive-output", "3:4", "--document-output", "2:3", "--arrival", "concurrency", "--concurrency", "4",
           "--out", str(tmp_path / "b"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={k: v for k, v in os.environ.items() if k != "PD_MODEL"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"model: {default_model_path().name} ({default_model_path()})" in proc.stdout
    assert "requests cut to fit it" in proc.stdout
    s = json.loads((tmp_path / "b" / "results.json").read_text())["runs"][0]["summary"]
    assert s["completed"] == 9 and s["errors"] == 0  # the 9th is a document (the first 8 are interactive)


@pytest.mark.slow
@pytest.mark.integration
def test_bench_prints_the_first_error_message(cluster, tmp_path):
    base_url, _, _ = cluster
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--url", base_url, "--model", str(default_model_path()),
           "--served-model-name", "no-such-model", "--workload", "fixed", "--prompt-tokens", "8", "--output-tokens", "2",
           "--num-requests", "2", "--arrival", "concurrency", "--out", str(tmp_path / "b"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1
    assert "2 of 2 requests failed; the first: HTTP 404" in proc.stdout and "no-such-model" in proc.stdout
