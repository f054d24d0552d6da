"""``load_model``: one entry point for HF folders, GGUF files and synthetic models, with weights.

Without weights use :func:`splitserve.model.info.load_model_info`, which does not import torch.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass
from pathlib import Path

from splitserve.dtypes import check_dtype_choice
from splitserve.model.config import ModelConfig
from splitserve.model.info import info_of, model_source, read_parts
from splitserve.model.llama import CausalLM, build_model
from splitserve.model.loader_gguf import load_gguf_file
from splitserve.model.loader_hf import load_hf_folder
from splitserve.model.synthetic import load_synthetic
from splitserve.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A ready-to-run model.

    Attributes:
        config: the model's ModelConfig.
        model: CausalLM in eval mode; ``model(input_ids, positions, kv_cache, attn)`` -> float32 logits.
            None when loaded with ``weights=False`` (config and tokenizer only).
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


logger = logging.getLogger(__name__)

_WITH_WEIGHTS = {"synthetic": load_synthetic, "hf": load_hf_folder, "gguf": load_gguf_file}


def load_model(path: str | Path, dtype: str = "float32", *, weights: bool = True, device: str = "cpu") -> LoadedModel:
    """Load a Hugging Face model folder or a ``.gguf`` file onto ``device`` (read and cast on the CPU, then moved).

    Args:
        path: HF folder (config.json + *.safetensors + tokenizer.json), a GGUF file, or
            ``"synthetic:NAME"`` (seeded random weights for benchmarks, see ``model.synthetic``).
        dtype: "float32" (default), "float16" or "bfloat16" for weights and the KV cache, or "auto": the
            checkpoint's (config.json ``torch_dtype``; a GGUF file's weight type, float32 for quantized
            types, which are dequantised at load; float32 for synthetic models).
        weights: False reads only config, tokenizer and generation settings (no tensors).
        device: "cpu" (default), "cuda" or "cuda:N": where the weights (and RoPE tables) live.
    Raises:
        FileNotFoundError: the path or a required file does not exist.
        ValueError: bad dtype, not a model folder/GGUF file, or malformed contents.
        NotImplementedError: an architecture or feature the model code does not support.
    """
    check_dtype_choice(dtype)
    source = model_source(path)
    parts = _WITH_WEIGHTS[source.kind](source.location, dtype) if weights else read_parts(source, dtype)
    info = info_of(parts, source.name)
    model = build_model(parts.config, parts.state_dict, device) if weights else None
    if model is not None:  # which path runs it: a worker's log says whether the CPU kernels serve this dtype
        path = "splitserve's CPU kernels, float32 activations" if model.packed_for_cpu else "torch"
        logger.info("loaded %s: %s weights and KV cache on %s, on %s", info.model_id, parts.config.dtype, device, path)
    return LoadedModel(
        config=info.config,
        model=model,
        tokenizer=info.tokenizer,
        model_id=info.model_id,
        eos_token_ids=info.eos_token_ids,
        max_model_len=info.max_model_len,
    )
