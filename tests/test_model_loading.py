"""Loader details: errors, model_id, tying, sharding, tokenizer/generation config variants, dtypes, GGUF layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.model import AttentionMetadata, ModelConfig, Tokenizer, load_model
from splitserve.model.loader_gguf import unpermute_rows
from splitserve.model.rope import rope_inv_freq


def models_dir() -> Path:
    """Prefer <repo>/models, fall back to ../shared/models beside the repo."""
    repo = Path(__file__).resolve().parents[1]
    for d in (repo / "models", repo.parent / "shared" / "models"):
        if (d / "TinyStories-656K").is_dir() and (d / "stories260K.gguf").is_file():
            return d
    pytest.skip("shipped test models not found")


def copy_model(tmp_path: Path, name: str = "TinyStories-656K") -> Path:
    dst = tmp_path / name
    shutil.copytree(models_dir() / "TinyStories-656K", dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def prefill_logits(lm, ids: list[int]) -> torch.Tensor:
    bs, n = 4, len(ids)
    nblk = -(-n // bs)
    cache = lm.model.allocate_kv_cache(nblk, bs)
    meta = AttentionMetadata(torch.arange(n), [n], [n], [list(range(nblk))], bs)
    return lm.model(torch.tensor(ids), torch.arange(n), cache, meta)[0]


IDS = [1, 80, 147, 201, 282, 57]


@pytest.fixture(scope="module")
def base():
    lm = load_model(models_dir() / "TinyStories-656K")
    return lm, prefill_logits(lm, IDS)


def test_public_types(base):
    lm, logits = base
    assert isinstance(lm.config, ModelConfig) and isinstance(lm.tokenizer, Tokenizer)
    assert lm.config.dtype == "float32" and logits.dtype == torch.float32 and logits.shape == (2048,)
    assert not lm.model.training and not any(p.requires_grad for p in lm.model.parameters())
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        lm.config.hidden_size = 3  # frozen


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="neither"):
        load_model(tmp_path / "x.txt")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match="dtype"):
        load_model(models_dir() / "TinyStories-656K", dtype="int8")


@pytest.mark.parametrize("patch, err, msg", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, NotImplementedError, "yarn"),
    ({"model_type": "gpt2"}, NotImplementedError, "gpt2"),
    ({"hidden_act": "gelu"}, NotImplementedError, "gelu"),
    ({"num_key_value_heads": 3}, ValueError, "multiple"),
    ({"hidden_size": None}, ValueError, "hidden_size"),
    ({"vocab_size": None}, ValueError, "vocab_size"),
])
def test_config_rejections(tmp_path, patch, err, msg):
    d = copy_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(patch)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(err, match=msg):
        load_model(d)


def test_model_id_stable_and_pathless(base, tmp_path):
    lm, _ = base
    again = load_model(copy_model(tmp_path))
    assert again.model_id == lm.model_id and "/" not in lm.model_id
    assert load_model(models_dir() / "TinyStories-656K", dtype="bfloat16").model_id != lm.model_id
    renamed = load_model(copy_model(tmp_path, "other-name"))
    assert renamed.model_id.startswith("other-name-") and renamed.model_id.split("-")[-1] == lm.model_id.split("-")[-1]


def test_tied_embedding_stored_as_embed_tokens_and_sharded_index(base, tmp_path):
    lm, ref = base
    d = copy_model(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.embed_tokens.weight"] = sd.pop("lm_head.weight")  # the other tying direction
    (d / "model.safetensors").unlink()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(d / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    got = load_model(d)
    torch.testing.assert_close(prefill_logits(got, IDS), ref, atol=0, rtol=0)
    assert got.model.lm_head.weight is got.model.model.embed_tokens.weight


def test_tokenizer_and_generation_config_variants(tmp_path):
    d = copy_model(tmp_path)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(add_bos_token=False, bos_token={"content": "<|start_story|>"}, eos_token={"content": "<|end_story|>"},
              chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    lm = load_model(d)
    tok = lm.tokenizer
    assert lm.eos_token_ids == (2, 5) and tok.eos_token_ids == (2, 5) and tok.eos_token == "<|end_story|>"
    assert tok.bos_token_id == 1 and not tok.add_bos_token
    assert tok.encode("Once upon a time") == [80, 147, 201, 282, 57]
    assert tok.chat_template.startswith("{% for m")
    assert tok.decode(IDS + [2]) == "Once upon a time" and "<|end_story|>" in tok.decode([80, 147, 2], skip_special_tokens=False)


def test_explicit_null_bos(tmp_path):
    d = copy_model(tmp_path)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(bos_token=None)
    tc.pop("add_bos_token")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = load_model(d).tokenizer
    assert tok.bos_token is None and tok.bos_token_id is None and not tok.add_bos_token
    assert tok.encode("Once upon a time") == IDS[1:]


def test_chat_template_file_and_config_fallbacks(tmp_path):
    d = copy_model(tmp_path)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    for k in ("add_bos_token", "bos_token", "eos_token"):
        tc.pop(k)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "special_tokens_map.json").unlink()
    (d / "generation_config.json").unlink()
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    lm = load_model(d)
    tok = lm.tokenizer
    # BOS/EOS from config.json ids; add_bos_token from the tokenizer.json post-processor (adds <|start_story|>)
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token, lm.eos_token_ids) == ("<|start_story|>", "<|end_story|>", True, (2,))
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert tok.encode("Once upon a time") == IDS


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision(base, dtype):
    lm32, ref = base
    lm = load_model(models_dir() / "TinyStories-656K", dtype=dtype)
    assert lm.config.dtype == dtype and lm.model.allocate_kv_cache(2, 4).dtype == getattr(torch, dtype)
    logits = prefill_logits(lm, IDS)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert int(logits.argmax()) == int(ref.argmax())
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.99
    # decode step (padded fast path with a mask) in reduced precision
    n, cache = len(IDS), lm.model.allocate_kv_cache(2, 4)
    lm.model(torch.tensor(IDS[:-1]), torch.arange(n - 1), cache, AttentionMetadata(torch.arange(n - 1), [n - 1], [n - 1], [[0, 1]], 4))
    dec = lm.model(torch.tensor(IDS[-1:]), torch.tensor([n - 1]), cache, AttentionMetadata(torch.tensor([n - 1]), [1], [n], [[0, 1]], 4))[0]
    assert int(dec.argmax()) == int(ref.argmax()) and torch.nn.functional.cosine_similarity(dec, ref, dim=0) > 0.99


def test_gguf_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(4 * 8, 5)
    torch.testing.assert_close(unpermute_rows(permute(w, 4), 4), w, atol=0, rtol=0)
    b = torch.randn(2 * 6)
    torch.testing.assert_close(unpermute_rows(permute(b, 2), 2), b, atol=0, rtol=0)


def test_gguf_metadata_quirks():
    lm = load_model(models_dir() / "stories260K.gguf")
    # separator/padding ids are 0xFFFFFFFF in the file: ignored, not special, not crashing
    assert lm.config.rope_theta == 10000.0 and lm.config.rms_norm_eps == pytest.approx(1e-5)
    assert all(lm.tokenizer.is_special(i) for i in (0, 1, 2)) and not lm.tokenizer.is_special(3)
    assert lm.tokenizer.decode([1, 403, 407, 261, 378, 2]) == "Once upon a time"
    smile = lm.tokenizer.encode("\U0001f642")  # not in the vocab: byte fallback "▁" <0xF0> <0x9F> <0x99> <0x82>
    assert [lm.tokenizer.hf.id_to_token(i) for i in smile[1:]] == ["▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert lm.tokenizer.decode(smile) == "\U0001f642"


def test_rope_scaling_inv_freq():
    base = rope_inv_freq(16, 10000.0)
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 2.0}), base / 2)
    l3 = rope_inv_freq(16, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert l3[0] == base[0] and torch.isclose(l3[-1], base[-1] / 8)
    with pytest.raises(NotImplementedError, match="dynamic"):
        rope_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("name", ["TinyStories-656K", "stories260K.gguf"])
def test_weights_false_loads_config_and_tokenizer_only(name):
    from splitserve.model import load_model
    from splitserve.paths import MODELS_DIR

    light, full = load_model(MODELS_DIR / name, weights=False), load_model(MODELS_DIR / name)
    assert light.model is None
    assert (light.model_id, light.max_model_len, light.eos_token_ids) == (full.model_id, full.max_model_len, full.eos_token_ids)
    assert light.tokenizer.encode("Once upon a time") == full.tokenizer.encode("Once upon a time")
