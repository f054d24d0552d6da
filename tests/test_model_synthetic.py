"""Synthetic benchmark models: deterministic weights, shapes, tokenizer, never-emitted tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve.model import AttentionMetadata, load_model
from splitserve.model.synthetic import SYNTHETIC_CONFIGS, never_emitted_token_ids, num_parameters, plain_token_ids


def test_same_name_same_weights_and_model_id():
    a, b = load_model("synthetic:llama-tiny"), load_model("synthetic:llama-tiny")
    assert a.model_id == b.model_id and a.model_id.startswith("synthetic-llama-tiny-")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.config.vocab_size == a.tokenizer.vocab_size == 2048 and a.max_model_len == 4096


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="llama-25m"):
        load_model("synthetic:nope")


@pytest.mark.parametrize("name", sorted(SYNTHETIC_CONFIGS))
def test_configs_load_without_weights_and_have_expected_size(name):
    lm = load_model(f"synthetic:{name}", weights=False)
    assert lm.model is None and lm.config.model_type in ("llama", "qwen2", "qwen3")
    millions = num_parameters(lm.config) / 1e6
    assert millions < 1 if name == "llama-tiny" else 20 < millions < 80


def test_greedy_never_picks_special_tokens():
    lm = load_model("synthetic:llama-tiny")
    excluded = set(never_emitted_token_ids(lm.tokenizer))
    assert {0, 1, 2} <= excluded and not excluded & set(plain_token_ids(lm.tokenizer))
    ids = torch.tensor(plain_token_ids(lm.tokenizer)[:64])
    cache = lm.model.allocate_kv_cache(16, 4)
    logits = []
    for i in range(8):  # 8 one-token sequences
        attn = AttentionMetadata(torch.tensor([i * 4]), [1], [1], [[i]], 4)
        logits.append(lm.model(ids[i : i + 1], torch.tensor([0]), cache, attn))
    top = torch.cat(logits).argmax(-1).tolist()
    assert not set(top) & excluded
