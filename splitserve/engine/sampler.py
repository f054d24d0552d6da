"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs, grammar masks.

API (shared with the engine): ``sample(logits, rows) -> list[SampleResult]`` and ``prompt_logprobs``.
Logprobs follow ``splitserve.engine.logprobs``: ``log_softmax`` of the processed logits, before temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.guided import GuidedMatcher
from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.engine.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant (splitmix64) to spread (seed, index)


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One sequence's next-token choice: its params (one choice's), the index of the token in its output
    (0 = first; seeds the draw with (seed, output_index)), its history, grammar matcher and the model's EOS ids."""

    params: SamplingParams
    output_index: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    matcher: GuidedMatcher | None = None
    eos_token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class SampleResult:
    """The chosen token and, when the request asked for ``logprobs``, its :class:`TokenLogprob`."""

    token_id: int
    logprob: TokenLogprob | None = None


def _generator(seed: int, output_index: int) -> torch.Generator:
    mixed = (seed * _SEED_MIX + output_index) & 0x7FFFFFFFFFFFFFFF
    return torch.Generator().manual_seed(mixed)


def _token_logprob(lp: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """``lp``: float32 ``[vocab]`` log-probabilities."""
    value = lp[token_id]
    rank = int((lp > value).sum().item()) + 1
    top = ()
    if k:
        vals, ids = torch.topk(lp, k)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id, float(value.item()), rank, top)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleResult]:
    """Choose one token per row of float32 ``logits [num_rows, vocab_size]``; returns one result per row."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    results = []
    for i, row in enumerate(rows):
        p = row.params
        row_logits = logits[i].float()
        if row.matcher is not None:
            mask = torch.ones(row_logits.shape[0], dtype=torch.bool)
            row.matcher.fill_mask(mask)
            row_logits = row_logits.masked_fill(~mask, float("-inf"))
            tokens[i] = int(torch.argmax(row_logits).item())
        if not p.greedy:
            scaled = row_logits / p.temperature
            if 0 < p.top_k < scaled.numel():
                kth = torch.topk(scaled, p.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
            gen = _generator(p.seed, row.output_index) if p.seed is not None else None
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
        lp = None
        if p.logprobs is not None:
            lp = _token_logprob(torch.log_softmax(row_logits, dim=-1), tokens[i], p.logprobs)
        results.append(SampleResult(tokens[i], lp))
    return results


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], k: int) -> PromptLogprobs:
    """Logprobs of the prompt tokens from raw logits ``[>= len(prompt_token_ids) - 1, vocab]`` (row ``j - 1``
    predicts token ``j``; extra rows are ignored). A chunk covering positions ``[s, e)`` passes its rows with
    ``prompt_token_ids[s:e + 1]``. Returns ``len(prompt_token_ids)`` entries, the first None.

    Raises:
        ValueError: fewer rows than ``len(prompt_token_ids) - 1``.
    """
    n = len(prompt_token_ids)
    if logits.shape[0] < n - 1:
        raise ValueError(f"prompt_logprobs needs {n - 1} rows of logits for {n} prompt tokens, got {logits.shape[0]}")
    lp = torch.log_softmax(logits[: max(n - 1, 0)].float(), dim=-1)
    return [None] + [_token_logprob(lp[j - 1], prompt_token_ids[j], k) for j in range(1, n)]
