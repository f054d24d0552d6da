"""Read a llama-family GGUF file (architectures llama, qwen2, qwen3) without its tensors' data:
metadata, config, tokenizer and EOS ids.

No torch (the router uses it through :func:`splitserve.model.info.load_model_info`); the tensors are
read by :mod:`splitserve.model.loader_gguf`. ``gguf`` itself needs numpy.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from splitserve.model.config import ARCHITECTURES, ModelConfig, ModelParts
from splitserve.model.gguf_tokenizer import build_gguf_tokenizer
from splitserve.dtypes import resolve_dtype
from splitserve.model.tokenizer import Tokenizer

ARCH_TO_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value fields (``GGUF.*`` header fields excluded) as Python values."""
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def _config(meta: dict[str, Any], arch: str, tensors: dict[str, Any], dtype: str) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{key}")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise NotImplementedError(f"per-layer {arch}.{key} values {sorted(set(value))} are not supported")
            value = value[0]
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise NotImplementedError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    if "rope_freqs.weight" in tensors:
        raise NotImplementedError("GGUF rope_freqs.weight (llama3 frequency factors) is not supported; use the HF folder")
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        scaling = None
    elif kind == "linear":
        scaling = {"factor": float(get("rope.scaling.factor")), "rope_type": "linear"}
    else:
        raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear)")
    model_type = ARCH_TO_TYPE[arch]
    return ModelConfig(
        architecture=ARCHITECTURES[model_type],
        model_type=model_type,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # GGUF dims are innermost-first
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm=model_type == "qwen3",
        attention_bias="blk.0.attn_q.bias" in tensors,
        dtype=dtype,
    )


_AUTO_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_dtype(tensors: dict[str, Any]) -> str:
    """The dtype ``--dtype auto`` runs a GGUF file in: the type most matrix weights are stored in (float32 for
    F32, float16 for F16, bfloat16 for BF16, float32 for quantised types, which are dequantised at load)."""
    kinds = Counter(t.tensor_type.name for t in tensors.values() if len(t.shape) >= 2)
    return _AUTO_DTYPES.get(kinds.most_common(1)[0][0], "float32") if kinds else "float32"


def _token_id(meta: dict[str, Any], key: str, n_vocab: int) -> int | None:
    """A special-token id, or None when absent or a placeholder (e.g. 0xFFFFFFFF)."""
    v = meta.get(f"tokenizer.ggml.{key}")
    return int(v) if isinstance(v, int) and 0 <= v < n_vocab else None


def read_gguf(path: Path, dtype: str = "float32") -> tuple[GGUFReader, ModelParts]:
    """The open reader and the file's config, tokenizer, EOS ids and context length (``state_dict`` empty).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file or missing metadata.
        NotImplementedError: unsupported architecture, tokenizer or RoPE variant.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors on bad magic or truncation
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCH_TO_TYPE:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(ARCH_TO_TYPE)})")
    raw = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in raw:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    config = _config(meta, arch, raw, resolve_dtype(dtype, checkpoint_dtype(raw)))

    hf_tok = build_gguf_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    bos_id = _token_id(meta, "bos_token_id", len(tokens))
    eos_ids = [i for i in (_token_id(meta, k, len(tokens)) for k in ("eos_token_id", "eot_token_id")) if i is not None]
    tok = Tokenizer(
        hf_tok,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")),
        chat_template=meta.get("tokenizer.chat_template") or None,
        extra_eos_token_ids=tuple(eos_ids),
    )
    eos = tuple(dict.fromkeys(eos_ids)) or tok.eos_token_ids
    return reader, ModelParts(config, {}, tok, eos, config.max_position_embeddings)
