"""Block-gather paged attention (decodes: splitserve's CPU kernel, and the torch path) equals the per-token
reference path (attention_ref.py): at block boundaries (prompt lengths block_size - 1, block_size, block_size + 1), for batches of sequences of
different lengths, for prefix-cached prefill chunks, and for grouped-query attention (4 and 2 query
heads per KV head, with and without Qwen3's q/k norm)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from splitserve.model import AttentionMetadata
from splitserve.model.llama import build_model
from splitserve.model.synthetic import synthetic_config, synthetic_state_dict

BS = 8


def tiny_model(kind: str):
    if kind == "llama-gqa2":
        cfg = synthetic_config("llama-tiny", vocab_size=256)  # 4 query heads, 2 KV heads
    else:  # qwen3 with 4 query heads per KV head
        cfg = dataclasses.replace(synthetic_config("llama-tiny", vocab_size=256), model_type="qwen3", architecture="Qwen3ForCausalLM",
                                  num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True)
    sd = synthetic_state_dict(kind, cfg, [])
    for k in sd:
        if k.endswith("norm.weight"):  # not all ones: the norms must be applied to the right heads
            sd[k] = 1 + 0.2 * torch.randn(sd[k].shape, generator=torch.Generator().manual_seed(len(k)))
    return build_model(cfg, sd)


class Pager:
    """Random, non-contiguous block ids per sequence; runs one packed step."""

    def __init__(self, model, num_blocks: int = 96):
        self.model, self.cache = model, model.allocate_kv_cache(num_blocks, BS)
        self.free = list(range(num_blocks))
        random.Random(1).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def run(self, batch: list[tuple[int, list[int], int]], reference: bool) -> torch.Tensor:
        """batch: (seq id, new tokens, cached len) -> logits [num_seqs, vocab]."""
        ids, pos, slots, tables = [], [], [], []
        for seq, toks, cached in batch:
            t = self.tables.setdefault(seq, [])
            while len(t) * BS < cached + len(toks):
                t.append(self.free.pop())
            tables.append(t)
            ids += toks
            pos += range(cached, cached + len(toks))
            slots += [t[p // BS] * BS + p % BS for p in range(cached, cached + len(toks))]
        meta = AttentionMetadata(torch.tensor(slots), [len(t) for _, t, _ in batch], [c + len(t) for _, t, c in batch], tables, BS)
        self.model.reference_attention = reference
        try:
            return self.model(torch.tensor(ids), torch.tensor(pos), self.cache, meta)
        finally:
            self.model.reference_attention = False


def both(pager: Pager, batch) -> torch.Tensor:
    """Run ``batch`` on both paths from the same cache; assert equal logits and caches; keep the paged cache."""
    before = pager.cache.clone()
    ref = pager.run(batch, reference=True)
    ref_cache, pager.cache = pager.cache, before
    got = pager.run(batch, reference=False)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pager.cache, ref_cache, atol=1e-5, rtol=1e-5)
    return got


@pytest.fixture(autouse=True, params=["cpu-kernel", "torch"])
def decode_attention(request, monkeypatch):
    """Both decode paths: splitserve's CPU kernel (in place) and the torch one (block gather + SDPA)."""
    monkeypatch.setenv("PD_CPU_KERNELS", "1" if request.param == "cpu-kernel" else "0")
    return request.param


@pytest.fixture(scope="module", params=["llama-gqa2", "qwen3-gqa4"])
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("prompt_len", [BS - 1, BS, BS + 1])
def test_single_sequence_at_block_boundaries(model, prompt_len):
    pager = Pager(model)
    toks = [(7 * i + 3) % 256 for i in range(prompt_len)]
    nxt = both(pager, [(0, toks, 0)]).argmax(-1).tolist()
    for step in range(BS + 2):  # decode across the next block boundary
        nxt = both(pager, [(0, nxt, prompt_len + step)]).argmax(-1).tolist()


def test_batch_of_different_lengths(model):
    lens = [BS - 1, BS, BS + 1, 2 * BS + 3, 1]
    pager = Pager(model)
    prompts = [[(5 * i + j) % 256 for j in range(n)] for i, n in enumerate(lens)]
    nxt = both(pager, [(i, p, 0) for i, p in enumerate(prompts)]).argmax(-1).tolist()  # packed prefills
    for step in range(BS + 1):  # batched decodes of different context lengths (padded + masked groups)
        nxt = both(pager, [(i, [nxt[i]], n + step) for i, n in enumerate(lens)]).argmax(-1).tolist()


def test_mixed_step_prefix_chunk_decode_and_fresh_prefill(model):
    pager = Pager(model)
    a, b, c = list(range(1, 3 * BS)), list(range(40, 40 + BS + 1)), list(range(90, 90 + BS - 1))
    both(pager, [(0, a[:BS + 1], 0), (1, b, 0)])
    # one step: seq 0 continues from a cached prefix (offset-causal mask), seq 1 decodes, seq 2 is new
    both(pager, [(0, a[BS + 1 :], BS + 1), (1, [9], len(b)), (2, c, 0)])
    both(pager, [(2, [4], len(c)), (0, [5], len(a))])  # decodes listed out of token order
