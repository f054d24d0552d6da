"""``load_model``: one entry point for HF folders and GGUF files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitserve.model.config import DTYPE_CHOICES, ModelConfig, make_model_id
from splitserve.model.llama import CausalLM, build_model
from splitserve.model.loader_gguf import load_gguf_file
from splitserve.model.loader_hf import load_hf_folder
from splitserve.model.synthetic import SYNTHETIC_PREFIX, is_synthetic, load_synthetic
from splitserve.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A ready-to-run model.

    Attributes:
        config: the model's ModelConfig.
        model: CausalLM in eval mode; ``model(input_ids, positions, kv_cache, attn)`` -> float32 logits.
            None when loaded with ``weights=False`` (config and tokenizer only, e.g. for the router).
        tokenizer: Tokenizer wrapper.
        model_id: ``"<name>-<12 hex of sha256(config.canonical_json())>"``; never a path.
        eos_token_ids: ids that end generation.
        max_model_len: longest supported context in tokens.
    """

    config: ModelConfig
    model: CausalLM | None
    tokenizer: Tokenizer
    model_id: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int


def load_model(path: str | Path, dtype: str = "float32", *, weights: bool = True) -> LoadedModel:
    """Load a Hugging Face model folder or a ``.gguf`` file onto the CPU.

    Args:
        path: HF folder (config.json + *.safetensors + tokenizer.json), a GGUF file, or
            ``"synthetic:NAME"`` (seeded random weights for benchmarks, see ``model.synthetic``).
        dtype: "float32" (default), "float16" or "bfloat16" for weights and the KV cache, or "auto": the
            checkpoint's (config.json ``torch_dtype``; a GGUF file's weight type, float32 for quantized
            types, which are dequantised at load; float32 for synthetic models).
        weights: False reads only config, tokenizer and generation settings (no tensors).
    Raises:
        FileNotFoundError: the path or a required file does not exist.
        ValueError: bad dtype, not a model folder/GGUF file, or malformed contents.
        NotImplementedError: an architecture or feature the model code does not support.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPE_CHOICES)}")
    if is_synthetic(path):
        name = str(path)[len(SYNTHETIC_PREFIX):]
        parts, name = load_synthetic(name, dtype, weights=weights), f"synthetic-{name}"
        return _loaded(parts, name, weights)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_dir():
        parts, name = load_hf_folder(p, dtype, weights=weights), p.resolve().name
    elif p.suffix.lower() == ".gguf":
        parts, name = load_gguf_file(p, dtype, weights=weights), p.stem
    else:
        raise ValueError(f"{p} is neither a model folder nor a .gguf file")
    return _loaded(parts, name, weights)


def _loaded(parts, name: str, weights: bool) -> LoadedModel:
    model = build_model(parts.config, parts.state_dict) if weights else None
    return LoadedModel(
        config=parts.config,
        model=model,
        tokenizer=parts.tokenizer,
        model_id=make_model_id(name, parts.config),
        eos_token_ids=tuple(parts.eos_token_ids),
        max_model_len=int(parts.max_model_len),
    )
