"""Load a llama-family GGUF file (architectures llama, qwen2, qwen3) into HF-named tensors.

Metadata, config and tokenizer come from :func:`splitserve.model.gguf_meta.read_gguf`. llama.cpp's
converter permutes the Q and K projection rows of "llama" models so that RoPE rotates adjacent pairs;
we undo that permutation to get HF's rotate-half layout. Tensor types F32, F16, BF16 and Q8_0 are
supported (tested); every tensor is dequantised to float32 at load with ``gguf.quants.dequantize`` (other
quantised types gguf can dequantise load too), then cast to the run dtype: quantised weights take their
full-precision size in memory and run as float matmuls. ``dtype="auto"``: see ``gguf_meta.checkpoint_dtype``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from splitserve.model.config import ModelParts
from splitserve.model.gguf_meta import read_gguf

_PERMUTED_ARCHS = {"llama"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp ``permute``: rows ``[n_head * head_dim, ...]`` from interleaved-pair to rotate-half order."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).contiguous()


def _to_torch(t: Any) -> torch.Tensor:
    arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF dims are innermost-first
    return torch.from_numpy(arr).reshape(shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def load_gguf_file(path: Path, dtype: str = "float32", *, weights: bool = True) -> ModelParts:
    """Read a GGUF model file (``weights=False``: no tensors, ``state_dict`` empty).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, missing metadata, or unknown tensors.
        NotImplementedError: unsupported architecture, tokenizer or RoPE variant.
    """
    reader, parts = read_gguf(path, dtype)
    if not weights:
        return parts
    config = parts.config
    permuted = config.model_type in _PERMUTED_ARCHS
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            raise ValueError(f"unexpected tensor {t.name!r} in {path}")
        w = _to_torch(t)
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            w = unpermute_rows(w, config.num_heads if ".q_proj." in hf else config.num_kv_heads)
        sd[hf] = w
    return parts._replace(state_dict=sd)
