"""Paged KV cache semantics: decode vs full forward, fast decode path vs per-sequence path, prefix caching."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from splitserve.model import AttentionMetadata, load_model

BS = 4  # block size


def models_dir() -> Path:
    """Prefer <repo>/models, fall back to ../shared/models beside the repo."""
    repo = Path(__file__).resolve().parents[1]
    for d in (repo / "models", repo.parent / "shared" / "models"):
        if (d / "TinyStories-656K").is_dir():
            return d
    pytest.skip("shipped test models not found")


@pytest.fixture(scope="module", params=["TinyStories-656K", "stories260K.gguf"])
def lm(request):
    return load_model(models_dir() / request.param)


class Pager:
    """Test-side block allocator: random, non-contiguous block ids per sequence."""

    def __init__(self, lm, num_blocks: int = 64, seed: int = 0):
        self.lm, self.cache = lm, lm.model.allocate_kv_cache(num_blocks, BS)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def table(self, seq: int, length: int) -> list[int]:
        t = self.tables.setdefault(seq, [])
        while len(t) * BS < length:
            t.append(self.free.pop())
        return t

    def meta(self, batch: list[tuple[int, int, int]]) -> AttentionMetadata:
        """batch: (seq id, cached len, new len) per sequence."""
        slots, tables = [], []
        for seq, cached, new in batch:
            t = self.table(seq, cached + new)
            tables.append(t)
            slots += [t[p // BS] * BS + p % BS for p in range(cached, cached + new)]
        return AttentionMetadata(torch.tensor(slots), [n for _, _, n in batch], [c + n for _, c, n in batch], tables, BS)

    def run(self, batch: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """batch: (seq id, new tokens, cached len) -> logits [num_seqs, vocab]."""
        ids = [t for _, toks, _ in batch for t in toks]
        pos = [c + i for _, toks, c in batch for i in range(len(toks))]
        meta = self.meta([(s, c, len(toks)) for s, toks, c in batch])
        return self.lm.model(torch.tensor(ids), torch.tensor(pos), self.cache, meta)


def full_forward(lm, ids: list[int]) -> torch.Tensor:
    """Last-token logits of one full prefill in a fresh cache (attends over the new K/V, no cached reads)."""
    return Pager(lm, num_blocks=len(ids) // BS + 2, seed=99).run([(0, ids, 0)])[0]


def prompts(lm) -> list[list[int]]:
    tok = lm.tokenizer
    return [tok.encode("Once upon a time"), tok.encode("Tim had a red ball. He liked to"), tok.encode("The sun")]


def test_token_by_token_decode_equals_full_forward(lm):
    seq = lm.tokenizer.encode("Once upon a time, there was a big dog named Max. Max liked")
    pager = Pager(lm)
    for i, t in enumerate(seq):
        step = pager.run([(0, [t], i)])[0]
        torch.testing.assert_close(step, full_forward(lm, seq[: i + 1]), atol=1e-4, rtol=1e-4)
    assert len(pager.tables[0]) == -(-len(seq) // BS) and pager.tables[0] != sorted(pager.tables[0])


def test_decode_fast_path_equals_per_sequence_path(lm):
    ps = prompts(lm)
    assert len({len(p) for p in ps}) == 3
    pager = Pager(lm)
    first = pager.run([(i, p, 0) for i, p in enumerate(ps)])  # batched mixed-length prefill
    for i, p in enumerate(ps):
        torch.testing.assert_close(first[i], full_forward(lm, p), atol=1e-4, rtol=1e-4)
    lens = [len(p) for p in ps]
    nxt = first.argmax(-1).tolist()
    for _ in range(5):  # several decode steps, crossing block boundaries
        batch = [(i, [nxt[i]], lens[i]) for i in range(3)]
        ref_cache = pager.cache.clone()
        lm.model.reference_attention = True
        try:
            slow = pager.run(batch)
        finally:
            lm.model.reference_attention = False
        slow_cache, pager.cache = pager.cache, ref_cache
        fast = pager.run(batch)
        torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
        assert torch.equal(pager.cache[:, 0], slow_cache[:, 0])  # layer 0 K/V do not depend on attention
        torch.testing.assert_close(pager.cache, slow_cache, atol=1e-4, rtol=1e-4)
        lens = [n + 1 for n in lens]
        nxt = fast.argmax(-1).tolist()


def test_decode_batch_equals_single_sequence_runs(lm):
    ps = prompts(lm)
    batched = Pager(lm)
    out = batched.run([(i, p, 0) for i, p in enumerate(ps)])
    nxt = out.argmax(-1).tolist()
    dec = batched.run([(i, [nxt[i]], len(p)) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        torch.testing.assert_close(dec[i], full_forward(lm, p + [nxt[i]]), atol=1e-4, rtol=1e-4)


def test_prefix_cached_prefill_equals_full_prefill(lm):
    seq = lm.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved")
    half = len(seq) // 2 + 1  # not block aligned
    pager = Pager(lm)
    pager.run([(0, seq[:half], 0)])
    got = pager.run([(0, seq[half:], half)])[0]
    torch.testing.assert_close(got, full_forward(lm, seq), atol=1e-4, rtol=1e-4)


def test_mixed_batch_prefix_prefill_decode_and_fresh_prefill(lm):
    a, b, c = prompts(lm)
    pager = Pager(lm)
    pager.run([(0, a[:3], 0), (1, b, 0)])
    # one call: seq 0 continues its prefill from a cached prefix, seq 1 decodes, seq 2 is a fresh prefill
    out = pager.run([(0, a[3:], 3), (1, [7], len(b)), (2, c, 0)])
    torch.testing.assert_close(out[0], full_forward(lm, a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], full_forward(lm, b + [7]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[2], full_forward(lm, c), atol=1e-4, rtol=1e-4)


def test_bad_metadata_raises_value_error(lm):
    pager = Pager(lm)
    ids = torch.tensor([1, 5, 6])
    good = pager.meta([(0, 0, 3)])
    with pytest.raises(ValueError, match="slot_mapping"):
        lm.model(ids, torch.arange(3), pager.cache, AttentionMetadata(good.slot_mapping.flip(0), [3], [3], good.block_tables, BS))
    with pytest.raises(ValueError, match="block table"):
        lm.model(ids, torch.arange(3), pager.cache, AttentionMetadata(good.slot_mapping, [3], [9], good.block_tables, BS))
    with pytest.raises(ValueError, match="query_len"):
        lm.model(ids, torch.arange(3), pager.cache, AttentionMetadata(good.slot_mapping, [3], [2], good.block_tables, BS))
    with pytest.raises(ValueError, match="sum"):
        lm.model(ids[:2], torch.arange(2), pager.cache, good)
    with pytest.raises(ValueError, match="block_size"):
        lm.model(ids, torch.arange(3), pager.cache, AttentionMetadata(good.slot_mapping, [3], [3], good.block_tables, 8))
    with pytest.raises(ValueError, match="dtype"):
        lm.model(ids, torch.arange(3), pager.cache.to(torch.bfloat16), good)
    with pytest.raises(ValueError, match="shape"):
        lm.model(ids, torch.arange(3), pager.cache[:, :1], good)
