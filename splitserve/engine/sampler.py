"""Token sampling: logits processors, logprobs, greedy / temperature / min-p / top-k / top-p, per-request seeds.

Order for one row (``splitserve.engine.logprobs`` documents the logprob convention):

1. processors (``splitserve.engine.logits_processors``): logit_bias, allowed_token_ids, bad words, grammar
   mask, min_tokens' EOS / stop-id ban, repetition then presence / frequency penalties;
2. logprobs: ``log_softmax`` of these processed logits (rank and top-k from them too);
3. greedy: argmax of the processed logits; otherwise temperature, min-p, top-k, top-p, then one draw from a
   generator seeded with (seed, output_index) when the request has a seed.

Rows without processors (the common case) are not copied: one argmax over the batch serves every greedy row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine import logits_processors as lp
from splitserve.engine.guided import GuidedMatcher
from splitserve.engine.logprob_calc import prompt_logprobs, token_logprobs
from splitserve.engine.logprobs import TokenLogprob
from splitserve.engine.sampling import SamplingParams

__all__ = ["SampleRow", "SampleResult", "sample", "prompt_logprobs"]

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant (splitmix64) to spread (seed, index)


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What the sampler needs to know about one sequence to choose its next token.

    Attributes:
        params: the sequence's sampling parameters (one choice's: ``SamplingParams.for_choice``).
        output_index: index of the token being sampled in the sequence's output (0 = first token); with a
            seed, the draw uses a generator seeded with (seed, output_index), so the result does not depend on
            which worker samples it. Also decides the min_tokens ban (``output_index < min_tokens``).
        prompt_token_ids: the prompt (used by the repetition penalty only).
        output_token_ids: the tokens generated so far (penalties, bad words).
        matcher: the sequence's structured-output matcher, or None; only ``fill_mask`` is called (the engine
            calls ``accept`` after sampling).
        eos_token_ids: the model's EOS ids (banned while ``output_index < min_tokens`` unless ignore_eos).
    """

    params: SamplingParams
    output_index: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    matcher: GuidedMatcher | None = None
    eos_token_ids: Sequence[int] = ()

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor changes this row's logits (otherwise they are used as they are)."""
        p = self.params
        return bool(self.matcher is not None or p.logit_bias or p.allowed_token_ids is not None
                    or p.bad_words_token_ids or self.output_index < p.min_tokens
                    or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


@dataclass(frozen=True, slots=True)
class SampleResult:
    """The chosen token and, when the request asked for ``logprobs``, its :class:`TokenLogprob`; ``error`` is set
    (and ``token_id`` meaningless) when the row's constraints leave no possible token: that request fails alone."""

    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None


def _generator(seed: int, output_index: int) -> torch.Generator:
    mixed = (seed * _SEED_MIX + output_index) & 0x7FFFFFFFFFFFFFFF
    return torch.Generator().manual_seed(mixed)


def process_row(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """The processed float32 copy of one row's logits ``[vocab_size]`` (step 1 of the module doc).

    Raises:
        ValueError: when the processors leave no possible token (e.g. every allowed_token_id outside the vocab).
    """
    p = row.params
    out = logits.float().clone()
    if p.logit_bias:
        lp.apply_logit_bias(out, p.logit_bias)
    if p.allowed_token_ids is not None:
        lp.apply_allowed_token_ids(out, p.allowed_token_ids)
    if p.bad_words_token_ids:
        lp.apply_bad_words(out, p.bad_words_token_ids, row.output_token_ids)
    if row.matcher is not None:
        lp.apply_grammar_mask(out, row.matcher)
    if row.output_index < p.min_tokens:
        lp.apply_min_tokens(out, tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(row.eos_token_ids)))
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        lp.apply_penalties(out, row.prompt_token_ids, row.output_token_ids,
                           p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    if not bool((out > lp.NEG_INF).any()):
        raise ValueError(f"the sampling constraints (allowed_token_ids / bad_words / grammar) leave no possible "
                         f"token at output index {row.output_index}")
    return out


def _draw(row_logits: torch.Tensor, p: SamplingParams, output_index: int) -> int:
    """Step 3 of the module doc for a non-greedy row: temperature, min-p, top-k, top-p, one draw."""
    row_logits = row_logits.float() / p.temperature
    if p.min_p > 0.0:
        # vLLM's min-p (Nguyen et al. 2024): drop tokens below min_p x the top token's probability
        probs = torch.softmax(row_logits, dim=-1)
        row_logits = row_logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
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
    gen = None
    if p.seed is not None:  # a seeded draw uses a CPU generator on every device: the same token wherever it runs
        gen = _generator(p.seed, output_index)
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleResult]:
    """Choose one token per row (and its logprob when asked).

    Args:
        logits: float32 ``[num_seqs, vocab_size]``, last-position logits; not modified.
        rows: one :class:`SampleRow` per logits row.

    Returns:
        ``num_seqs`` :class:`SampleResult`; ``logprob`` is set for rows whose ``params.logprobs`` is not None;
        ``error`` for a row whose constraints leave no possible token (the other rows are sampled as usual).

    Raises:
        ValueError: when ``len(rows)`` differs from the number of logits rows.
    """
    if len(rows) != logits.shape[0]:
        raise ValueError(f"sample got {logits.shape[0]} logits rows for {len(rows)} sample rows")
    processed: dict[int, torch.Tensor] = {}
    errors: dict[int, str] = {}
    for i, row in enumerate(rows):
        if row.needs_processing:
            try:
                processed[i] = process_row(logits[i], row)
            except ValueError as exc:  # this request's constraints contradict each other: it alone fails
                errors[i] = str(exc)
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, row in enumerate(rows):
        if i in errors:
            continue
        row_logits = processed.get(i)
        if not row.params.greedy:
            tokens[i] = _draw(logits[i] if row_logits is None else row_logits, row.params, row.output_index)
        elif row_logits is not None:
            tokens[i] = int(torch.argmax(row_logits).item())
    results = [SampleResult(t, error=errors.get(i)) for i, t in enumerate(tokens)]
    want = [i for i, row in enumerate(rows) if row.params.logprobs is not None and i not in errors]
    if want:
        stacked = torch.stack([processed.get(i, logits[i]).float() for i in want])
        values = token_logprobs(torch.log_softmax(stacked, dim=-1), [tokens[i] for i in want],
                                [rows[i].params.logprobs for i in want])
        for i, value in zip(want, values):
            results[i] = SampleResult(tokens[i], value)
    return results
