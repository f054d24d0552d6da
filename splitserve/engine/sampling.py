"""Sampling parameters of one request (OpenAI semantics, vLLM field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


GREEDY_TEMPERATURE = 1e-5
_INT32_MAX = 2**31 - 1


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

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= _INT32_MAX:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (as vLLM's _SAMPLING_EPS): dividing logits by a tinier one
        overflows float32 to inf/NaN probabilities."""
        return self.temperature < GREEDY_TEMPERATURE
