"""Model configuration: one frozen dataclass shared by the HF and GGUF loaders.

``ModelConfig`` holds only what the math needs. ``config_from_hf`` reads a Hugging Face
``config.json`` dict (transformers 4 and 5 spellings of RoPE settings) and rejects what the
model code cannot run with ``NotImplementedError``. ``make_model_id`` gives the stable identity
``"<name>-<12 hex of sha256(canonical config json)>"``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)  # --dtype; "auto" = the checkpoint's dtype (vLLM's rule)

# model_type -> HF architecture class name
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
        architecture: HF class name, e.g. "LlamaForCausalLM".
        model_type: "llama", "mistral", "qwen2" or "qwen3".
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: sizes.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: None for plain RoPE, else a dict with "rope_type" ("linear" or "llama3") and its
            parameters (e.g. "factor").
        max_position_embeddings: trained context length in tokens.
        tie_word_embeddings: lm_head shares the input embedding matrix.
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        attention_bias: q/k/v projections have a bias (o_proj too, except for qwen2).
        dtype: "float32", "float16" or "bfloat16" -- weights and KV cache dtype.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if self.model_type not in ARCHITECTURES:
            raise NotImplementedError(f"model_type {self.model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def o_proj_bias(self) -> bool:
        """Qwen2 has q/k/v biases but no o_proj bias; Llama/Qwen3 ``attention_bias`` covers all four."""
        return self.attention_bias and self.model_type != "qwen2"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def canonical_json(self) -> str:
        """Key-sorted compact JSON of all fields; the input of ``make_model_id``."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


def make_model_id(name: str, config: ModelConfig) -> str:
    """``"<name>-<first 12 hex of sha256 of config.canonical_json()>"``."""
    digest = hashlib.sha256(config.canonical_json().encode("utf-8")).hexdigest()[:12]
    return f"{name}-{digest}"


def normalize_rope_scaling(scaling: dict | None) -> dict | None:
    """Canonical rope scaling dict (``"rope_type"`` key, no ``rope_theta``), or None for plain RoPE.

    Raises:
        NotImplementedError: for rope types other than default, linear, llama3.
    """
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return None
    out["rope_type"] = rope_type
    return dict(sorted(out.items()))


def config_from_hf(cfg: dict[str, Any], dtype: str = "float32") -> ModelConfig:
    """Build a ModelConfig from a parsed HF ``config.json``.

    Raises:
        NotImplementedError: unsupported architecture, activation, MLP bias, partial rotary or rope type.
        ValueError: missing or inconsistent sizes.
    """
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise NotImplementedError(f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only 'silu' / SwiGLU)")
    if cfg.get("mlp_bias"):
        raise NotImplementedError("mlp_bias=true is not supported")
    def num(key: str, default: Any = None, kind: type = int) -> Any:
        value = cfg.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"config.json is missing required field {key!r}")
            value = default
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"config.json field {key!r} must be a number, got {value!r}") from None

    hidden, heads = num("hidden_size"), num("num_attention_heads")
    rope_params = cfg.get("rope_parameters") or {}
    if cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    scaling = cfg.get("rope_scaling") or rope_params or None
    archs = cfg.get("architectures") or [ARCHITECTURES[model_type]]
    return ModelConfig(
        architecture=str(archs[0]),
        model_type=model_type,
        vocab_size=num("vocab_size"),
        hidden_size=hidden,
        intermediate_size=num("intermediate_size"),
        num_layers=num("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=num("num_key_value_heads", heads),
        head_dim=num("head_dim", hidden // heads if heads else 0),
        rms_norm_eps=num("rms_norm_eps", 1e-6, float),
        rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
        rope_scaling=normalize_rope_scaling(scaling),
        max_position_embeddings=num("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
        dtype=dtype,
    )


def resolve_dtype(dtype: str, checkpoint_dtype: str) -> str:
    """The weights/KV dtype to run: ``dtype``, or ``checkpoint_dtype`` when ``dtype`` is "auto".

    Raises:
        ValueError: ``dtype`` is not one of ``DTYPE_CHOICES``.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPE_CHOICES)}")
    return checkpoint_dtype if dtype == "auto" else dtype


def hf_checkpoint_dtype(cfg: dict[str, Any]) -> str:
    """The dtype a HF ``config.json`` declares (``torch_dtype``, transformers 5: ``dtype``); float32 when
    absent or not one of float32/float16/bfloat16 (e.g. float64)."""
    value = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    return {"float": "float32", "half": "float16"}.get(value, value) if value in (*DTYPES, "float", "half") else "float32"


def sliding_window_of(cfg: dict[str, Any]) -> int | None:
    """The attention window a HF config actually enables (Mistral: ``sliding_window``; Qwen: only
    when ``use_sliding_window``), or None. We run full attention, so callers cap the context at it."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window)


class ModelParts(NamedTuple):
    """What a loader hands to ``load_model``: config, HF-named tensors, tokenizer and serving limits."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any  # splitserve.model.tokenizer.Tokenizer
    eos_token_ids: tuple[int, ...]
    max_model_len: int
