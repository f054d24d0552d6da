"""The served model as the front end sees it: name, tokenizer, context length (no weights)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitserve.model import Tokenizer, load_model


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # the ``model`` field of OpenAI requests and responses
    tokenizer: Tokenizer
    max_model_len: int  # tokens, prompt + completion


def load_served_model(path: str, served_name: str | None = None) -> ServedModel:
    """Load what the router needs from a HF folder or GGUF file. Raises FileNotFoundError / ValueError."""
    lm = load_model(path, weights=False)
    return ServedModel(served_name or Path(path).name.removesuffix(".gguf"), lm.tokenizer, lm.max_model_len)
