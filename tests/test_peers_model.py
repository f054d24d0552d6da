"""benchmarks/peers/make_model.py: the peer-comparison model loads in splitserve both as a HF folder and as a GGUF
file with the same weights, tokenizer and greedy tokens, and transformers reads the HF folder the same way.
Writing and loading the 103 MB model twice takes ~20 s on two busy cores: those tests are slow."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest
import torch

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.model import load_model
from splitserve.model.synthetic import num_parameters, synthetic_config
from splitserve.paths import REPO_ROOT, default_model_path

PROMPTS = ["Once upon a time", "Lily and Tim went to the park.", 'She said, "Hi!"\nThe end.', "The big dog ran fast"]


def _module():
    spec = importlib.util.spec_from_file_location("peers_make_model", REPO_ROOT / "benchmarks" / "peers" / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    mm = _module()
    folder, gguf_path = mm.make_model(tmp_path_factory.mktemp("peers"), seed=0)
    return mm, folder, gguf_path


async def _greedy(lm, prompt: list[int], n: int = 12) -> list[int]:
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await engine.start()
    try:
        out = []
        async for o in engine.generate("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)):
            out += o.token_ids
        return out
    finally:
        await engine.stop()


def test_shapes_are_synthetic_llama_25m():
    shapes = _module().hf_shapes(synthetic_config("llama-25m"))
    assert sum(torch.Size(s).numel() for s in shapes.values()) == num_parameters(synthetic_config("llama-25m"))
    assert shapes["model.layers.7.self_attn.k_proj.weight"] == (256, 512) and shapes["lm_head.weight"] == (2048, 512)


@pytest.mark.slow
def test_weights_are_seeded(written):
    mm, folder, _ = written
    from safetensors.torch import load_file

    a, b = mm.make_state_dict(0), load_file(str(folder / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same seed writes the same model
    assert torch.count_nonzero(a["lm_head.weight"][[0, 1, 2]]) == 0 and torch.count_nonzero(a["lm_head.weight"][3:]) > 0


def test_gguf_scores_follow_merge_order():
    """The merges recovered from the GGUF scores (as llama.cpp merges: highest score first) tokenize like HF's BPE."""
    from tokenizers import Tokenizer

    from splitserve.model.gguf_tokenizer import build_gguf_tokenizer

    tokens, scores, types = _module().gguf_vocab(default_model_path() / "tokenizer.json")
    assert types[:4] == [2, 3, 3, 1] and len(tokens) == len(scores) == 2048
    gg = build_gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                               "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types})
    hf = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    for text in [*PROMPTS, "One day, a little girl named Sue found a shiny red ball under the tree."]:
        assert gg.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False).ids, text


@pytest.mark.slow
async def test_hf_folder_and_gguf_load_alike_and_greedy_tokens_match(written):
    _, folder, gguf_path = written
    hf, gg = load_model(folder), load_model(gguf_path)
    assert gg.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert replace(gg.config, rms_norm_eps=hf.config.rms_norm_eps) == hf.config
    assert (hf.config.hidden_size, hf.config.num_layers, hf.config.num_kv_heads, hf.config.head_dim) == (512, 8, 4, 64)
    assert hf.max_model_len == gg.max_model_len == 4096 and hf.eos_token_ids == gg.eos_token_ids == (2,)
    sh, sg = hf.model.state_dict(), gg.model.state_dict()
    assert sh.keys() == sg.keys() and all(torch.equal(sh[k], sg[k]) for k in sh)  # GGUF Q/K permutation undone exactly
    for text in PROMPTS:
        assert hf.tokenizer.encode(text) == gg.tokenizer.encode(text), text
    for text in PROMPTS[:2]:
        ids = hf.tokenizer.encode(text)
        toks = await _greedy(hf, ids)
        assert toks == await _greedy(gg, ids), text
        assert len(toks) == 12 and not {0, 1, 2} & set(toks)


@pytest.mark.slow
def test_transformers_reads_the_folder_as_splitserve_does(written):
    transformers = pytest.importorskip("transformers")
    _, folder, _ = written
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    ref = transformers.LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    lm = load_model(folder)
    for text in PROMPTS:
        assert lm.tokenizer.encode(text) == tok(text).input_ids, text
    ids = lm.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        ref_toks = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    import asyncio

    assert asyncio.run(_greedy(lm, ids, 8)) == ref_toks


@pytest.mark.slow
async def test_the_bf16_gguf_holds_the_folders_weights_rounded_as_torch_rounds_them(written, tmp_path):
    """make_bf16_gguf.py (llama.cpp at bf16): the GGUF loads as bfloat16 (--dtype auto) with the HF folder's weights
    cast to bfloat16, bit for bit, so both engines of a bf16 peers run start from the same numbers."""
    import subprocess
    import sys

    _, folder, _ = written
    subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "peers" / "make_bf16_gguf.py"), "--out", str(tmp_path),
                    "--model-dir", str(folder.parent)], check=True, capture_output=True, cwd=REPO_ROOT)
    from_gguf = load_model(tmp_path / "llama-25m-seed0.gguf", "auto")
    from_folder = load_model(tmp_path / "llama-25m-seed0", "bfloat16")
    assert from_gguf.config.dtype == "bfloat16"
    a, b = from_gguf.model.state_dict(), from_folder.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
