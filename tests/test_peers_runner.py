"""benchmarks/peers/ runner pieces that need no peer engine: request rewriting for llama.cpp, the skip line for
a missing venv, the table's ratios, and stopping a whole process tree."""

from __future__ import annotations

import sys
import time

import pytest

from splitserve.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "peers"))
import peer_engines as eng
import peer_suite as suite


def _build(name, tmp_path):
    return eng.build(name, hf_dir=tmp_path / "m", gguf=tmp_path / "m.gguf", peers_home=tmp_path, threads=2, served="m",
                     splitserve_args=[], up_args=["--no-store"])


def test_llama_cpp_requests_are_text_and_greedy_without_repeat_penalty(tmp_path):
    (tmp_path / "llama-cpp").mkdir()
    (tmp_path / "llama-cpp" / ".installed").touch()
    engine = _build("llama.cpp", tmp_path)
    assert engine.single_stream_only and "--n_threads" in engine.argv and "--model_alias" in engine.argv
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = eng.RewritingTransport(engine, lambda ids: "text " + ",".join(map(str, ids))).rewrite(body)
    assert out == {"model": "m", "prompt": "text 5,6,7", "max_tokens": 4, "temperature": 0, "stream": True, "repeat_penalty": 1.0}


def test_vllm_and_splitserve_requests_are_unchanged(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / ".installed").touch()
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for name in ("vllm", "splitserve-colocated", "splitserve-disagg"):
        engine = _build(name, tmp_path)
        assert eng.RewritingTransport(engine, str).rewrite(body) == body, name
    vllm = _build("vllm", tmp_path)
    assert vllm.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and vllm.env["OMP_NUM_THREADS"] == "2"
    assert _build("splitserve-disagg", tmp_path).argv[3] == "up"


def test_missing_venv_is_a_skip_line_that_says_how_to_install(tmp_path):
    assert "install.sh vllm" in _build("vllm", tmp_path)
    assert "install.sh llama-cpp" in _build("llama.cpp", tmp_path)
    with pytest.raises(ValueError, match="known"):
        _build("tgi", tmp_path)


def test_table_has_ratios_to_each_peer():
    results = {"splitserve-colocated": {"single": {"decode_tps": 150.0}, "conc16": {"itl_p50": 10.0}},
               "vllm": {"single": {"decode_tps": 100.0}, "conc16": {"itl_p50": 20.0}},
               "llama.cpp": {"single": {"decode_tps": 300.0}}}
    text = suite.table(results, ["splitserve-colocated", "vllm", "llama.cpp"])
    single = next(line for line in text.splitlines() if line.startswith("| single-stream"))
    assert single == "| single-stream decode, tokens/s | 150 | 100 | 300 | 1.50× | 0.50× |"
    itl = next(line for line in text.splitlines() if line.startswith("| conc 16: ITL p50"))
    assert itl == "| conc 16: ITL p50 (ms) | 10.0 | 20.0 | — | 0.50× | — |"


def test_stop_ends_the_whole_process_tree(tmp_path):
    engine = eng.Engine("t", ["sh", "-c", "trap '' TERM; sleep 60 & sleep 60 & wait"], "http://127.0.0.1:1", "m")
    eng.start(engine, tmp_path / "t.log")
    deadline = time.monotonic() + 10
    while len(eng.process_tree(engine.proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = eng.process_tree(engine.proc.pid)
    assert len(tree) == 3
    killed = eng.stop(engine, grace_s=0.5)  # the shell ignores SIGTERM: everything is SIGKILLed by pid
    assert set(killed) <= set(tree) and engine.proc.pid in killed
    assert not any(eng._alive(p) for p in tree)
