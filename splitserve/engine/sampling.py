"""Sampling parameters of one request (OpenAI semantics, vLLM field names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from splitserve.engine.guided_spec import GuidedSpec


GREEDY_TEMPERATURE = 1e-5
_INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_N = 128



def seed_from_signed(seed: int) -> int:
    """The engine's seed, in [0, 2**63), for a request's signed 64-bit ``seed`` (OpenAI and vLLM take any int64):
    ``seed mod 2**63``, so a negative seed draws as that.

    Raises:
        ValueError: ``seed`` outside [-2**63, 2**63).
    """
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must be a signed 64-bit integer, in [-2**63, 2**63), got {seed}")
    return seed % 2**63

@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen and when generation stops.

    Attributes:
        max_tokens: most tokens to generate (>= 1), including the first token that prefill returns.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: per-request seed. With a seed, the token at output index i is drawn from a
            generator seeded with (seed, i), so a request gives the same tokens whether it
            runs colocated or split across prefill and decode workers.
        stop_token_ids: extra token ids that end generation (the token is emitted).
        ignore_eos: keep generating past the model's EOS tokens.
        presence_penalty / frequency_penalty: in [-2, 2], OpenAI's: subtract ``presence * (count > 0) +
            frequency * count`` from a token's logit, counts over the *output* tokens so far.
        repetition_penalty: > 0 (1 = off), CTRL's (Keskar et al. 2019) as transformers and vLLM apply it:
            a logit of a token seen in the prompt or the output is divided by it when positive, multiplied
            when negative.
        min_p: in [0, 1]; drop tokens whose probability is below ``min_p`` times the top token's.
        min_tokens: no EOS or stop token id before this many output tokens.
        logit_bias: ``(token_id, bias)`` pairs, bias in [-100, 100], added to the logits.
        bad_words_token_ids: token-id sequences that must not be generated (the last token of a sequence is
            banned when the output ends with the rest of it).
        allowed_token_ids: when set, only these tokens may be generated.
        logprobs: when set (0..20), every output token carries its logprob and this many top alternatives.
        prompt_logprobs: when set (0..20), the prompt tokens' logprobs are returned (prefill computes them).
        n: number of choices (>= 1); one prefill, then n sequences share the prompt's KV blocks. Choice i
            draws with seed ``seed + i`` (vLLM's rule) when a seed is set.
        guided: a structured-output constraint (:class:`GuidedSpec`), or None.

    Raises:
        ValueError: on any out-of-range value.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    guided: GuidedSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= _INT32_MAX:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):  # (a request's signed seed: seed_from_signed)
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias maps non-negative token ids to biases in [-100, 100]")
        if any(not seq or any(t < 0 for t in seq) for seq in self.bad_words_token_ids):
            raise ValueError("bad_words must be non-empty token-id sequences")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as vLLM's _SAMPLING_EPS): dividing logits by a tinier one
        overflows float32 to inf/NaN probabilities."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_history(self) -> bool:
        """Whether sampling depends on the tokens generated so far (penalties, min_tokens, bad words)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.bad_words_token_ids)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an n > 1 request: n = 1 and, with a seed, ``seed + index``
        (vLLM's ``ParentRequest`` rule), so every choice draws its own tokens reproducibly."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed)
