"""Benchmark workloads and arrivals: shapes, seeds, shared prefixes for equal hash_ids, trace scaling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitserve.bench import arrivals
from splitserve.bench.workloads import azure, fit_to_context, mooncake, synthetic_fixed, synthetic_mixed
from splitserve.paths import REPO_ROOT

VOCAB = list(range(10, 500))


def test_mixed_has_interactive_warmup_then_periodic_documents_and_is_seeded():
    w = synthetic_mixed(VOCAB, 30, seed=1, document_every=5, warm_interactive=8)
    kinds = [r.kind for r in w.requests]
    assert kinds[:8] == ["interactive"] * 8
    assert [i for i, k in enumerate(kinds) if k == "document"] == [8, 13, 18, 23, 28]
    for r in w.requests:
        lo, hi = (1024, 1536) if r.kind == "document" else (32, 128)
        assert lo <= len(r.prompt_token_ids) <= hi and set(r.prompt_token_ids) <= set(VOCAB)
        assert (8 <= r.max_tokens <= 16) if r.kind == "document" else (128 <= r.max_tokens <= 192)
    assert w.info["documents"] == 5 and w.arrivals_s is None
    assert synthetic_mixed(VOCAB, 30, seed=1, document_every=5).requests == w.requests
    assert synthetic_mixed(VOCAB, 30, seed=2, document_every=5).requests != w.requests
    with pytest.raises(ValueError):
        synthetic_mixed(VOCAB, 0, seed=1)


def test_fixed_lengths():
    w = synthetic_fixed(VOCAB, 4, 0, prompt_tokens=17, output_tokens=5)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in w.requests] == [(17, 5)] * 4


def _write_mooncake(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_mooncake_equal_hash_ids_share_real_token_prefixes(tmp_path):
    f = tmp_path / "trace.jsonl"
    _write_mooncake(f, [
        {"timestamp": 1000, "input_length": 1536, "output_length": 64, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1200, "output_length": 32, "hash_ids": [0, 1, 7]},  # shares 2 blocks
        {"timestamp": 3000, "input_length": 512, "output_length": 8, "hash_ids": [9]},  # shares nothing
    ])
    w = mooncake(f, VOCAB, seed=3, input_scale=32, output_scale=2, time_scale=2.0)
    a, b, c = (r.prompt_token_ids for r in w.requests)
    assert w.info["block_tokens"] == 16 and (len(a), len(b), len(c)) == (48, 38, 16)  # 1536/32, round(1200/32), 512/32
    assert a[:32] == b[:32] and a[32:48] != b[32:48]  # blocks 0,1 identical; block 2 vs 7 differ
    assert c != a[:16]
    assert [r.max_tokens for r in w.requests] == [32, 16, 4]
    assert w.arrivals_s == pytest.approx([0.0, 1.0, 4.0])  # (ms - first) / 1000 * time_scale
    assert w.info["reused_block_fraction"] == pytest.approx(2 / 7, abs=1e-4)  # blocks 0 and 1 of b repeat a's
    assert mooncake(f, VOCAB, seed=3, input_scale=32, output_scale=2).requests == w.requests
    assert mooncake(f, VOCAB, seed=4, input_scale=32, output_scale=2).requests[0] != w.requests[0]


def test_mooncake_fits_context_and_reads_a_slice(tmp_path):
    f = tmp_path / "trace.jsonl"
    _write_mooncake(f, [{"timestamp": i * 10, "input_length": 512 * 20, "output_length": 100, "hash_ids": list(range(20))} for i in range(5)])
    w = mooncake(f, VOCAB, seed=0, input_scale=1, max_requests=2, start=1, max_model_len=1000)
    assert len(w.requests) == 2 and w.info["truncated_to_context"] == 2
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 1000 for r in w.requests)
    with pytest.raises(ValueError, match="not a Mooncake record"):
        _write_mooncake(f, [{"timestamp": 0}])
        mooncake(f, VOCAB, seed=0)


def test_azure_csv_replay(tmp_path):
    f = tmp_path / "azure.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
                 "2023-11-16 18:17:04.4799600,400,3\n2023-11-16 18:17:06.0000000,40,1\n")
    w = azure(f, VOCAB, seed=0, input_scale=4, time_scale=0.5)
    assert [len(r.prompt_token_ids) for r in w.requests] == [1202, 100, 10]
    assert [r.max_tokens for r in w.requests] == [10, 3, 1]
    assert w.arrivals_s == pytest.approx([0.0, 0.25, 1.0101], abs=1e-3)


def test_real_mooncake_trace_keeps_prefix_sharing():
    f = REPO_ROOT / "benchmarks" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"  # shipped
    w = mooncake(f, VOCAB, seed=0, input_scale=32)
    assert len(w.requests) == 3993 and 0.6 < w.info["reused_block_fraction"] < 0.7  # SOURCES.md: 64%
    by_first = {}
    for r in w.requests:  # requests starting with the same 16-token block share it exactly
        by_first.setdefault(r.prompt_token_ids[:16], []).append(r)
    assert max(len(v) for v in by_first.values()) > 1


def test_arrivals_are_seeded_and_have_the_requested_rate():
    a = arrivals.poisson(4.0, 2000, seed=7)
    assert a == arrivals.poisson(4.0, 2000, seed=7) and a != arrivals.poisson(4.0, 2000, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.1)
    bursty = np.diff(arrivals.gamma(4.0, 4000, seed=1, burstiness=0.25))
    regular = np.diff(arrivals.gamma(4.0, 4000, seed=1, burstiness=4.0))
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(shape)
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.5, rel=0.15)
    assert arrivals.from_timestamps([10.0, 12.0, 11.0], 3.0) == [0.0, 6.0, 3.0]
    with pytest.raises(ValueError):
        arrivals.poisson(0, 3, 0)


def test_fit_to_context_cuts_prompts_then_outputs():
    w = synthetic_fixed(VOCAB, 3, seed=0, prompt_tokens=600, output_tokens=100)
    fitted, cut = fit_to_context(w, 512)
    assert cut == 3
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 512 for r in fitted.requests)
    assert fitted.requests[0].prompt_token_ids == w.requests[0].prompt_token_ids[:len(fitted.requests[0].prompt_token_ids)]
    assert fitted.info["truncated_to_context"] == 3
    same, none_cut = fit_to_context(w, 4096)
    assert same is w and none_cut == 0
    with pytest.raises(ValueError, match="max_model_len"):
        fit_to_context(w, 1)


def test_a_missing_trace_is_one_line_naming_where_it_goes(tmp_path):
    from splitserve.bench.cli import main

    with pytest.raises(SystemExit, match="no trace file at .*nope.jsonl"):
        main(["--workload", "mooncake", "--trace", str(tmp_path / "nope.jsonl"), "--model", "synthetic:llama-tiny",
              "--url", "http://127.0.0.1:9"])
