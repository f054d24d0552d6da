"""Decode batches are split into groups of similar context length (max <= 2 x min), same results."""

from __future__ import annotations

import pytest
import torch

from splitserve.model import AttentionMetadata, load_model
from splitserve.model.attention import plan_attention

BS = 4


def decode_meta(ctxs: list[int]) -> AttentionMetadata:
    tables, n = [], 0
    for c in ctxs:
        k = -(-(c + 1) // BS)
        tables.append(list(range(n, n + k)))
        n += k
    slots = torch.tensor([t[c // BS] * BS + c % BS for t, c in zip(tables, ctxs)])
    return AttentionMetadata(slots, [1] * len(ctxs), [c + 1 for c in ctxs], tables, BS)


def test_long_context_decode_gets_its_own_group(monkeypatch):
    monkeypatch.setenv("PD_CPU_KERNELS", "0")  # the torch path groups decodes; the CPU kernel takes them all at once
    ctxs = [30, 300, 35, 31, 290]
    cache = torch.zeros(200, 1, 2, BS, 1, 8)
    plan = plan_attention(decode_meta(ctxs), len(ctxs), cache)
    groups = [sorted(g.tokens.tolist()) for g in plan.decode_groups]
    assert groups == [[0, 2, 3], [1, 4]]
    assert [(g.num_blocks, g.length) for g in plan.decode_groups] == [(9, 36), (76, 301)]  # padded to whole blocks of the longest context


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_grouped_decode_equals_per_sequence_path(kernels, monkeypatch):
    monkeypatch.setenv("PD_CPU_KERNELS", kernels)
    lm = load_model("synthetic:llama-tiny")
    ctxs = [3, 40, 5, 90, 41]
    meta = decode_meta(ctxs)
    cache = lm.model.allocate_kv_cache(sum(len(t) for t in meta.block_tables), BS)
    torch.manual_seed(0)
    cache.normal_()
    ids, pos = torch.tensor([100, 200, 300, 400, 500]), torch.tensor(ctxs)
    fast = lm.model(ids, pos, cache.clone(), meta)
    lm.model.reference_attention = True
    try:
        slow = lm.model(ids, pos, cache.clone(), meta)
    finally:
        lm.model.reference_attention = False
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
