"""The served model as the front end sees it: name, tokenizer, context length (no weights, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitserve.model.info import load_model_info
from splitserve.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # the ``model`` field of OpenAI requests and responses
    tokenizer: Tokenizer  # chat template, BOS rules, eos_token_ids
    max_model_len: int  # tokens, prompt + completion


def load_served_model(path: str, served_name: str | None = None) -> ServedModel:
    """Load what the router needs from a HF folder, GGUF file or ``synthetic:NAME`` without weights or torch.

    Raises FileNotFoundError / ValueError / NotImplementedError (see ``load_model_info``).
    """
    info = load_model_info(path)
    return ServedModel(served_name or Path(path).name.removesuffix(".gguf"), info.tokenizer, info.max_model_len)
