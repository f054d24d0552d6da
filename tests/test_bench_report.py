"""Benchmark client SSE handling (mock transport), report files, comparison table and targets."""

from __future__ import annotations

import json

import httpx
import pytest

from splitserve.bench.client import RequestRecord, request_body, run_requests
from dataclasses import replace

from splitserve.bench.compare import ServerSettings, build_config, command_lines, targets, warmup_specs
from splitserve.bench.metrics import SLO
from splitserve.bench.report import RunResult, comparison_table, write_results
from splitserve.bench.workloads import RequestSpec, synthetic_mixed


def sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    if body["max_tokens"] == 99:
        return httpx.Response(400, json={"error": {"message": "too long"}})
    if body["max_tokens"] == 98:
        return httpx.Response(200, content=sse({"choices": [{"text": "a"}]}, {"error": {"message": "boom"}}))
    n = body["max_tokens"]
    chunks = [{"choices": [{"text": f"t{i}", "finish_reason": None}]} for i in range(n)]
    chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                            "prompt_tokens_details": {"cached_tokens": 2}}})
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0 and body["stream_options"]["include_usage"]
    return httpx.Response(200, content=sse(*chunks), headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("mode", ["arrivals", "concurrency"])
async def test_client_records_chunks_usage_and_errors(mode):
    specs = [RequestSpec(0, (5, 6, 7), 4, "fixed"), RequestSpec(1, (5,), 99, "fixed"), RequestSpec(2, (5,), 98, "fixed"),
             RequestSpec(3, (1, 2), 1, "fixed")]
    kw = {"arrivals_s": [0.0, 0.0, 0.01, 0.02]} if mode == "arrivals" else {"concurrency": 2}
    records, duration = await run_requests("http://bench.test", "m", specs, progress=False, transport=httpx.MockTransport(handler), **kw)
    ok, http_err, stream_err, one = records
    assert ok.ok and ok.chunks == 4 and len(ok.itl_s) == 3 and ok.output_tokens == 4 and ok.cached_tokens == 2
    assert ok.prompt_tokens == 3 and ok.ttft_s >= 0 and ok.e2e_s >= ok.ttft_s and ok.tpot_s is not None
    assert not http_err.ok and http_err.error.startswith("HTTP 400") and "too long" in http_err.error
    assert not stream_err.ok and "boom" in stream_err.error
    assert one.ok and one.tpot_s is None and one.itl_s == []
    assert duration >= 0 and [r.index for r in records] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        await run_requests("http://x", "m", specs, progress=False)


def test_request_body_is_openai_completions_with_token_ids():
    body = request_body(RequestSpec(0, (1, 2), 3, "x"), "synthetic:llama-25m")
    assert body["prompt"] == [1, 2] and body["model"] == "synthetic:llama-25m" and body["max_tokens"] == 3


def _fake_run(config: str, itl_ms: float, ttft_s: float) -> RunResult:
    records = []
    for i in range(10):
        kind = "document" if i == 5 else "interactive"
        records.append(RequestRecord(i, kind, 10, start_s=i * 0.1, ttft_s=ttft_s, itl_s=[itl_ms / 1000] * 9,
                                     e2e_s=ttft_s + 9 * itl_ms / 1000, prompt_tokens=100, output_tokens=10, chunks=10))
    return RunResult(config, records, 2.0, SLO(ttft_ms=200, tpot_ms=50))


def test_write_results_json_markdown_and_pngs(tmp_path):
    w = synthetic_mixed(list(range(10, 100)), 10, 0)
    runs = [_fake_run("colocated-unchunked", 90, 0.1), _fake_run("colocated-chunked", 40, 0.3), _fake_run("disaggregated", 20, 0.1)]
    paths = write_results(tmp_path, w, runs, {"model": "m"}, "extra notes")
    data = json.loads(paths["json"].read_text())
    assert [r["config"] for r in data["runs"]] == ["colocated-unchunked", "colocated-chunked", "disaggregated"]
    assert len(data["runs"][0]["requests"]) == 10 and data["workload"]["type"] == "synthetic-mixed"
    for key in ("ttft_cdf", "itl_cdf", "timeline_disaggregated"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert "| ITL p99 (ms) | 90.00 | 40.00 | 20.00 | 0.44× | 0.22× | 0.50× |" in md and "extra notes" in md
    assert "disaggregated ÷ colocated-chunked" in comparison_table(runs)
    met = targets(w, runs)
    assert met[0].endswith("MET (10 ms to spare)") and met[1].endswith("MET")
    # attainment: unchunked misses the TPOT SLO (90 ms), chunked the TTFT SLO (300 ms), disaggregated meets both
    assert [round(r.summary["slo_attainment"], 2) for r in runs] == [0.0, 0.0, 1.0]


def test_compare_configs_pin_workers_and_enable_chunking():
    s = ServerSettings(model="synthetic:llama-tiny", max_num_batched_tokens=128)
    chunked, _ = build_config("colocated-chunked", s)
    argv = chunked.children[0].argv
    assert argv[2:5] == ["splitserve.bench.pin", "0,1", "--"] and "--enable-chunked-prefill" in argv
    assert argv[argv.index("--torch-threads") + 1] == "2" and argv[argv.index("--max-num-batched-tokens") + 1] == "128"
    disagg, url = build_config("disaggregated", s)
    pins = {c.name: c.argv[3] if "splitserve.bench.pin" in c.argv else None for c in disagg.children}
    assert pins == {"prefill-0": "0", "decode-0": "1", "router": None} and url.startswith("http://127.0.0.1:")
    niced, _ = build_config("disaggregated", replace(s, nice=-5))
    lines = command_lines(niced)
    assert lines[0].startswith("taskset -c 0 nice -n -5 splitserve prefill --model synthetic:llama-tiny")
    assert lines[2].startswith("taskset -c ") and " router " in lines[2]
    with pytest.raises(ValueError, match="unknown configuration"):
        build_config("nope", s)
    w = synthetic_mixed(list(range(10, 100)), 20, 0)
    assert [r.kind for r in warmup_specs(w)] == ["interactive", "document", "interactive"]
