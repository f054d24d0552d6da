"""Log-probabilities of sampled and prompt tokens (what ``logprobs`` / ``prompt_logprobs`` return).

Convention (documented in the README's API section): a logprob is ``log_softmax`` of the *processed* logits,
float32: after the logit-shaping steps that decide which tokens are possible or preferred (``logit_bias``,
``allowed_token_ids``, ``bad_words``, ``min_tokens``' EOS ban, repetition / presence / frequency penalties,
a structured-output grammar's mask), and before temperature and the truncations (top-k, top-p, min-p). So
a request without those processors reports the model's raw distribution (vLLM's default ``raw_logprobs``,
transformers' ``log_softmax``), and temperature never changes a logprob, as with OpenAI.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one chosen (or prompt) token and the ``k`` most likely alternatives at its position.

    Attributes:
        token_id: the token.
        logprob: its log-probability (natural log, float; ``-inf`` for a masked token).
        rank: its 1-based rank in the distribution (1 = most likely), as vLLM reports it.
        top: up to k ``(token_id, logprob)`` pairs, most likely first (k = the request's
            ``logprobs`` / ``prompt_logprobs``; empty when k is 0).
    """

    token_id: int
    logprob: float
    rank: int = 1
    top: tuple[tuple[int, float], ...] = ()


PromptLogprobs = list[TokenLogprob | None]
"""One entry per prompt token; the first is None (no context to predict it from, as OpenAI's echo)."""
