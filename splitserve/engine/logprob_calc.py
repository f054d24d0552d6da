"""Computing :class:`TokenLogprob` values from logits (conventions in ``splitserve.engine.logprobs``).

Ranks follow vLLM: 1 + the number of tokens with a strictly larger logprob (ties share the better rank).
Top alternatives are ``torch.topk`` of the logprobs, most likely first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob

_PROMPT_ROWS_PER_CHUNK = 256  # 256 x 152k vocab x 4 bytes = 156 MB per float32 temporary


def token_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per row.

    Args:
        logprobs: float32 ``[num_rows, vocab_size]``, log-softmax of the logits of each row.
        token_ids: the chosen token of each row (``num_rows`` ids).
        ks: how many top alternatives each row reports (0..20).

    Returns:
        ``num_rows`` TokenLogprobs (``logprob`` of the chosen token, its 1-based ``rank``, ``top`` pairs).
    """
    if not token_ids:
        return []
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = ((logprobs > chosen).count_nonzero(dim=1) + 1).tolist()
    chosen_list = chosen[:, 0].tolist()
    k_max = min(max(ks), logprobs.shape[1])
    top_vals: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k_max > 0:
        top = torch.topk(logprobs, k_max, dim=1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(token_id=int(t), logprob=chosen_list[i], rank=int(ranks[i]),
                     top=tuple(zip(top_ids[i][:ks[i]], top_vals[i][:ks[i]])))
        for i, t in enumerate(token_ids)
    ]


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], k: int) -> PromptLogprobs:
    """Logprobs of the prompt tokens, from the raw logits (``log_softmax`` in float32, no processors).

    Args:
        logits: ``[num_positions, vocab_size]`` logits of the prompt's positions, at least
            ``len(prompt_token_ids) - 1`` rows; row ``j - 1`` predicts prompt token ``j`` (extra rows, e.g. the
            last position's, are ignored). A chunk of a chunked prefill covering positions ``[s, e)`` passes its
            own rows with ``prompt_token_ids[s:e + 1]`` and drops the first (None) entry of the result.
        prompt_token_ids: the prompt's token ids.
        k: top alternatives per position (0..20).

    Returns:
        ``len(prompt_token_ids)`` entries; the first is None (nothing predicts it, as OpenAI's ``echo``).

    Raises:
        ValueError: when ``logits`` has fewer than ``len(prompt_token_ids) - 1`` rows.
    """
    n = len(prompt_token_ids)
    if n == 0:
        return []
    if logits.shape[0] < n - 1:
        raise ValueError(f"prompt_logprobs needs {n - 1} rows of logits for {n} prompt tokens, got {logits.shape[0]}")
    result: PromptLogprobs = [None]
    for start in range(0, n - 1, _PROMPT_ROWS_PER_CHUNK):  # bounds the [rows, vocab] temporaries
        end = min(start + _PROMPT_ROWS_PER_CHUNK, n - 1)
        lp = torch.log_softmax(logits[start:end].float(), dim=-1)
        result += token_logprobs(lp, prompt_token_ids[start + 1:end + 1], [k] * (end - start))
    return result
