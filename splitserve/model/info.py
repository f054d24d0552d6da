"""What a model is without its weights: config, tokenizer, model_id, EOS ids, context length.

``load_model_info`` reads a HF folder, a GGUF file or a ``synthetic:NAME`` model and never imports
torch (the router and ``splitserve up`` use it); ``splitserve.model.load_model`` adds the weights.
Reading a GGUF file imports ``gguf`` (and so numpy) on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from splitserve.dtypes import check_dtype_choice
from splitserve.model.config import ModelConfig, ModelParts, make_model_id
from splitserve.model.synthetic import SYNTHETIC_PREFIX, is_synthetic, load_synthetic
from splitserve.model.tokenizer import Tokenizer

SourceKind = Literal["synthetic", "hf", "gguf"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind``, the display ``name`` (model_id prefix) and its ``location``
    (the synthetic name, the HF folder or the GGUF file)."""

    kind: SourceKind
    name: str
    location: str | Path


@dataclass(frozen=True)
class ModelInfo:
    """A model as the control plane needs it.

    Attributes:
        config: the model's ModelConfig.
        tokenizer: Tokenizer wrapper (chat template, BOS/EOS rules).
        model_id: ``"<name>-<12 hex of sha256(config.canonical_json())>"``; never a path.
        eos_token_ids: ids that end generation.
        max_model_len: longest supported context in tokens (prompt + completion).
    """

    config: ModelConfig
    tokenizer: Tokenizer
    model_id: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int


def model_source(path: str | Path) -> ModelSource:
    """Classify ``path``: ``"synthetic:NAME"``, a HF folder or a ``.gguf`` file.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: neither a folder nor a .gguf file.
    """
    if is_synthetic(path):
        name = str(path)[len(SYNTHETIC_PREFIX):]
        return ModelSource("synthetic", f"synthetic-{name}", name)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_dir():
        return ModelSource("hf", p.resolve().name, p)
    if p.suffix.lower() == ".gguf":
        return ModelSource("gguf", p.stem, p)
    raise ValueError(f"{p} is neither a model folder nor a .gguf file")


def read_parts(source: ModelSource, dtype: str = "float32") -> ModelParts:
    """Config, tokenizer, EOS ids and context length of ``source``; ``state_dict`` is empty.

    Raises:
        FileNotFoundError: a required file is missing.
        ValueError: malformed contents or unknown synthetic name.
        NotImplementedError: an architecture or feature the model code does not support.
    """
    if source.kind == "synthetic":
        return load_synthetic(str(source.location), dtype, weights=False)
    if source.kind == "hf":
        from splitserve.model.hf_folder import read_hf_folder

        return read_hf_folder(Path(source.location), dtype)
    from splitserve.model.gguf_meta import read_gguf  # imports gguf and numpy

    return read_gguf(Path(source.location), dtype)[1]


def info_of(parts: ModelParts, name: str) -> ModelInfo:
    """The ModelInfo of loaded ``parts`` named ``name`` (the model_id prefix)."""
    return ModelInfo(
        config=parts.config,
        tokenizer=parts.tokenizer,
        model_id=make_model_id(name, parts.config),
        eos_token_ids=tuple(parts.eos_token_ids),
        max_model_len=int(parts.max_model_len),
    )


def load_model_info(path: str | Path, dtype: str = "float32") -> ModelInfo:
    """Read a model's config, tokenizer and generation settings (no tensors, no torch).

    Args:
        path: HF folder (config.json + tokenizer.json), a GGUF file, or ``"synthetic:NAME"``.
        dtype: "float32" (default), "float16" or "bfloat16"; part of the config, hence of model_id.
    Raises:
        FileNotFoundError: the path or a required file does not exist.
        ValueError: bad dtype, not a model folder/GGUF file, or malformed contents.
        NotImplementedError: an architecture or feature the model code does not support.
    """
    check_dtype_choice(dtype)
    source = model_source(path)
    return info_of(read_parts(source, dtype), source.name)
