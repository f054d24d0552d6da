"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from splitserve.engine.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant (splitmix64) to spread (seed, index)


def _generator(seed: int, output_index: int) -> torch.Generator:
    mixed = (seed * _SEED_MIX + output_index) & 0x7FFFFFFFFFFFFFFF
    return torch.Generator().manual_seed(mixed)


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """Choose one token per row.

    Args:
        logits: float32 ``[num_seqs, vocab_size]``, last-position logits.
        params: sampling parameters per row.
        output_indices: index of the token being sampled in each request's output (0 = first token);
            with a seed, row i draws from a generator seeded with (seed, output_indices[i]), so the
            result does not depend on which worker samples it.

    Returns:
        One token id per row.
    """
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        row_logits = logits[row].float() / p.temperature
        if 0 < p.top_k < row_logits.numel():
            kth = torch.topk(row_logits, p.top_k).values[-1]
            row_logits = row_logits.masked_fill(row_logits < kth, float("-inf"))
        probs = torch.softmax(row_logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = _generator(p.seed, output_indices[row]) if p.seed is not None else None
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
