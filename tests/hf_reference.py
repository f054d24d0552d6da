"""Hugging Face transformers (fp32) as the reference the API-parity tests compare the served model with: greedy
continuations with each step's log-softmax, and prompt logprobs. Logprobs are natural-log (nats)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Step:
    """One greedy step: the chosen ``token_id``, its ``logprob`` and the ``top`` k logprobs (descending)."""

    token_id: int
    logprob: float
    top: list[float]


class HFReference:
    """The model at ``path`` in fp32 with its tokenizer (BOS added to text, as the server adds it)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with BOS first."""
        return self.tok(text).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def log_softmax(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32: row i is the distribution of the token after ids[: i + 1]."""
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)

    def greedy(self, prompt_ids: list[int], max_tokens: int, k: int = 1) -> list[Step]:
        """``max_tokens`` greedy steps after ``prompt_ids`` (stops after EOS), each with its top ``k`` logprobs."""
        ids, steps = list(prompt_ids), []
        for _ in range(max_tokens):
            row = self.log_softmax(ids)[-1]
            top = torch.topk(row, k).values.tolist()
            token = int(row.argmax())
            steps.append(Step(token, float(row[token]), top))
            ids.append(token)
            if token == self.tok.eos_token_id:
                break
        return steps

    def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """OpenAI's echo convention: None for the first token, then log p(ids[i] | ids[:i])."""
        rows = self.log_softmax(ids)
        return [None] + [float(rows[i - 1, ids[i]]) for i in range(1, len(ids))]
