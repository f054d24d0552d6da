"""Parity of splitserve.model against transformers (test-only dependency) on real and random models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from splitserve.model import AttentionMetadata, load_model

transformers = pytest.importorskip("transformers")

PROMPT = "Once upon a time"
N_NEW = 32


def models_dir() -> Path:
    """Prefer <repo>/models, fall back to ../shared/models beside the repo."""
    repo = Path(__file__).resolve().parents[1]
    for d in (repo / "models", repo.parent / "shared" / "models"):
        if (d / "TinyStories-656K").is_dir() and (d / "stories260K.gguf").is_file():
            return d
    pytest.skip("shipped test models not found")


def paged_run(lm, ids: list[int], n_new: int, block_size: int = 4):
    """Prefill ``ids`` then decode greedily ``n_new`` tokens through a paged cache with a shuffled block table.

    Returns (greedy tokens, float32 logits ``[n_new, vocab]``): row j is the prediction for position len(ids) + j.
    """
    total = len(ids) + n_new
    nblk = -(-total // block_size)
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(nblk * 2, generator=gen)[:nblk]).tolist()
    cache = lm.model.allocate_kv_cache(nblk * 2, block_size)

    def step(toks: list[int], start: int) -> torch.Tensor:
        pos = list(range(start, start + len(toks)))
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in pos])
        meta = AttentionMetadata(slots, [len(toks)], [start + len(toks)], [table], block_size)
        return lm.model(torch.tensor(toks), torch.tensor(pos), cache, meta)[0]

    logits = step(ids, 0)
    out, rows = [], [logits]
    for _ in range(n_new):
        out.append(int(logits.argmax()))
        logits = step([out[-1]], len(ids) + len(out) - 1)
        rows.append(logits)
    return out, torch.stack(rows[:-1])


def check_against_hf(lm, hf_model, ids: list[int], n_new: int = N_NEW, atol: float = 1e-4) -> list[int]:
    """Last-prompt-token logits, greedy tokens, and the logits of every decode step match HF."""
    x = torch.tensor([ids])
    with torch.no_grad():
        ref_all = hf_model(x).logits[0].float()
        ref_gen = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, min_new_tokens=n_new,
                                    do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    toks, step_logits = paged_run(lm, ids, n_new)
    torch.testing.assert_close(step_logits[0], ref_all[-1], atol=atol, rtol=1e-4)
    assert toks == ref_gen
    # logits along the whole generated sequence vs one HF forward over prompt + generated
    with torch.no_grad():
        ref_seq = hf_model(torch.tensor([ids + toks])).logits[0, len(ids) - 1 : -1].float()
    torch.testing.assert_close(step_logits, ref_seq, atol=atol, rtol=1e-4)
    return toks


# ---------------------------------------------------------------- TinyStories-656K (HF folder)

@pytest.fixture(scope="module")
def tinystories():
    path = models_dir() / "TinyStories-656K"
    ref = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path), ref, path


def test_tinystories_config_and_tokenizer(tinystories):
    lm, _, path = tinystories
    c = lm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (2, 128, 8, 4, 16, 2048)
    assert c.tie_word_embeddings and lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert lm.eos_token_ids == (2,) and lm.max_model_len == 512
    assert lm.model_id.startswith("TinyStories-656K-") and len(lm.model_id.rsplit("-", 1)[1]) == 12
    tok = lm.tokenizer
    assert (tok.bos_token_id, tok.bos_token, tok.eos_token, tok.add_bos_token) == (1, "<|start_story|>", "<|end_story|>", True)
    assert tok.chat_template is None and tok.vocab_size == 2048 and tok.is_special(2) and not tok.is_special(80)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in (PROMPT, "Lily and Tim went to the park.", "Hello\nworld"):
        assert tok.encode(text) == hf_tok(text).input_ids
    ids = tok.encode(PROMPT)
    assert ids[0] == 1 and tok.encode(PROMPT, add_special_tokens=False) == ids[1:]
    assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=True)[0] == 1
    assert 2 not in ids


def test_tinystories_logits_and_greedy_match_transformers(tinystories):
    lm, ref, _ = tinystories
    ids = lm.tokenizer.encode(PROMPT)
    toks = check_against_hf(lm, ref, ids)
    assert lm.tokenizer.decode(toks).startswith(", a little girl named Lily")


# ---------------------------------------------------------------- stories260K (GGUF)

@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory):
    """Our model from the shipped file; transformers from a copy without the 0xFFFFFFFF token ids
    (separator/padding), which transformers' GGUF loader cannot handle."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    src = models_dir() / "stories260K.gguf"
    tmp = tmp_path_factory.mktemp("gguf")
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(tmp / src.name), arch=reader.fields["general.architecture"].contents())
    copy_with_new_metadata(reader, writer, {}, ["tokenizer.ggml.seperator_token_id", "tokenizer.ggml.padding_token_id"])
    import transformers.modeling_utils as mu

    # transformers insists on `accelerate` for GGUF although it is not needed on CPU; it is not installed.
    saved = mu.is_accelerate_available
    mu.is_accelerate_available = lambda *a, **k: True
    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=src.name, dtype=torch.float32).eval()
    finally:
        mu.is_accelerate_available = saved
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp), gguf_file=src.name)
    return load_model(src), ref, hf_tok


def test_gguf_config_and_tokenizer(stories_gguf):
    lm, ref, hf_tok = stories_gguf
    c = lm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (5, 64, 8, 4, 8, 172)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings, c.model_type) == (512, 10000.0, False, "llama")
    assert lm.model_id.startswith("stories260K-") and lm.eos_token_ids == (2,) and lm.max_model_len == 2048
    tok = lm.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token, tok.vocab_size) == (1, (2,), True, 512)
    for text in (PROMPT, "Lily and Tim went to the park.", "She said, \"Hi!\"\nThe end.", "zebra émoji"):
        assert tok.encode(text) == hf_tok(text).input_ids, text
        assert tok.decode(tok.encode(text)) == text
    q_rows, k_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim  # qkv_proj outputs: q, k, v
    torch.testing.assert_close(lm.model.model.layers[0].self_attn.qkv_proj.weight[:q_rows], ref.model.layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(lm.model.model.layers[4].self_attn.qkv_proj.weight[q_rows : q_rows + k_rows],
                               ref.model.layers[4].self_attn.k_proj.weight)


def test_gguf_logits_and_greedy_match_transformers(stories_gguf):
    lm, ref, _ = stories_gguf
    ids = lm.tokenizer.encode(PROMPT)
    toks = check_against_hf(lm, ref, ids)
    assert lm.tokenizer.decode(toks).startswith(", there was a little girl named Lily.")


# ---------------------------------------------------------------- random Qwen3 / Qwen2 / Llama-3 models

def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (incl. zero-init biases and unit norms) distinct random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "embed" in name else 0.15))


def _save_random(kind: str, tmp: Path, tokenizer_src: Path):
    common = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, tie_word_embeddings=True, rope_theta=1e6, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "mistral_linear":
        cfg = transformers.MistralConfig(head_dim=24, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                         tie_word_embeddings=False, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:  # llama with llama3 rope scaling and attention bias on all four projections
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
        cfg = transformers.LlamaConfig(rope_scaling=scaling, attention_bias=True, tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(cfg)
    _randomize(model.eval(), seed=len(kind))
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / f, tmp / f)
    return model


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama3rope", "mistral_linear"])
def test_random_models_match_transformers(kind, tmp_path):
    ref = _save_random(kind, tmp_path, models_dir() / "TinyStories-656K")
    lm = load_model(tmp_path)
    c = lm.config
    assert c.qk_norm == (kind == "qwen3") and c.attention_bias == (kind in ("qwen2", "llama3rope"))
    assert c.tie_word_embeddings == (kind == "qwen3") and (c.num_heads, c.num_kv_heads) == (4, 2)
    if kind == "llama3rope":
        assert c.rope_scaling["rope_type"] == "llama3"
    if kind == "mistral_linear":
        assert (c.model_type, c.head_dim, c.rope_scaling) == ("mistral", 24, {"factor": 4.0, "rope_type": "linear"})
    ids = lm.tokenizer.encode(PROMPT + " there was a dog")
    toks = check_against_hf(lm, ref, ids, n_new=24)
    assert len(set(toks)) > 3  # a non-degenerate continuation
