"""Synthetic benchmark models: Llama/Qwen-shaped configs with seeded random weights.

Selected with ``--model synthetic:NAME`` (see ``SYNTHETIC_CONFIGS``). They exist so that prefill
and decode cost what a real model of that shape costs on this CPU; the generated text is
meaningless. Every process builds bit-identical weights (a generator seeded from the name), so a
prefill worker and a decode worker of the same ``synthetic:NAME`` agree on model_id, KV layout and
the math.

The tokenizer is the shipped TinyStories-656K one (vocab 2048). The ``lm_head`` rows of special
tokens (and of byte-fallback ``<0x..>`` tokens, which that vocabulary does not have) are zero while
every other row is random, so greedy decoding never picks them: each generated token is then
visible text, i.e. one SSE chunk, which keeps client-side inter-token latency exact (with
temperature > 0 they are as likely as any other token). Embeddings are untied.

Importing this module does not import torch (``splitserve up`` and the router read the names and
configs); only building the weights does.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from splitserve.dtypes import resolve_dtype
from splitserve.model.config import ARCHITECTURES, ModelConfig, ModelParts
from splitserve.model.hf_folder import load_tokenizer
from splitserve.model.tokenizer import Tokenizer
from splitserve.paths import default_model_path

if TYPE_CHECKING:
    import torch

SYNTHETIC_PREFIX = "synthetic:"
INIT_STD = 0.02  # HF initializer_range
MAX_MODEL_LEN = 4096

# name -> (model_type, hidden, intermediate, layers, heads, kv_heads, head_dim)
SYNTHETIC_CONFIGS: dict[str, tuple[str, int, int, int, int, int, int]] = {
    "llama-tiny": ("llama", 128, 384, 2, 4, 2, 32),  # ~0.8 M params: tests
    "llama-25m": ("llama", 512, 1408, 8, 8, 4, 64),
    "llama-65m": ("llama", 768, 2048, 10, 12, 4, 64),
    "qwen2-30m": ("qwen2", 576, 1536, 8, 9, 3, 64),
    "qwen3-45m": ("qwen3", 640, 1792, 10, 10, 2, 64),
}

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def is_synthetic(path: object) -> bool:
    return isinstance(path, str) and path.startswith(SYNTHETIC_PREFIX)


def synthetic_config(name: str, dtype: str = "float32", vocab_size: int = 2048) -> ModelConfig:
    """The ModelConfig of ``synthetic:<name>``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in SYNTHETIC_CONFIGS:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(sorted(SYNTHETIC_CONFIGS))}")
    model_type, hidden, inter, layers, heads, kv_heads, head_dim = SYNTHETIC_CONFIGS[name]
    return ModelConfig(
        architecture=ARCHITECTURES[model_type], model_type=model_type, vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=False, qk_norm=model_type == "qwen3", attention_bias=model_type == "qwen2", dtype=dtype,
    )


def never_emitted_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Special and byte-fallback token ids (their lm_head rows are zero)."""
    ids = {i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)}
    ids.update(i for tok, i in tokenizer.hf.get_vocab(with_added_tokens=True).items() if _BYTE_TOKEN.match(tok))
    return sorted(ids)


def plain_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids that are ordinary text pieces (not special, not byte fallback): safe to build prompts from."""
    excluded = set(never_emitted_token_ids(tokenizer))
    return [i for i in range(tokenizer.vocab_size) if i not in excluded]


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"splitserve-synthetic/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def synthetic_state_dict(name: str, config: ModelConfig, excluded: list[int]) -> dict[str, torch.Tensor]:
    """Seeded random tensors with Hugging Face names (float32; ``build_model`` casts to the dtype)."""
    import torch

    from splitserve.model.llama import CausalLM

    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in CausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(_seed(name))
    sd = {}
    for key in sorted(shapes):
        if key.endswith("norm.weight"):
            sd[key] = torch.ones(shapes[key])
        elif key.endswith(".bias"):
            sd[key] = torch.randn(shapes[key], generator=gen) * INIT_STD
        else:
            sd[key] = torch.randn(shapes[key], generator=gen) * INIT_STD
    sd["lm_head.weight"][excluded] = 0.0
    return sd


def load_synthetic(name: str, dtype: str = "float32", *, weights: bool = True) -> ModelParts:
    """ModelParts for ``synthetic:<name>`` (tokenizer and generation settings of TinyStories-656K).

    Raises:
        ValueError: unknown name.
    """
    folder = default_model_path()
    tokenizer = load_tokenizer(folder, {"bos_token_id": 1, "eos_token_id": 2}, [2])
    config = synthetic_config(name, resolve_dtype(dtype, "float32"), tokenizer.vocab_size)
    sd = synthetic_state_dict(name, config, never_emitted_token_ids(tokenizer)) if weights else {}
    return ModelParts(config, sd, tokenizer, tokenizer.eos_token_ids, MAX_MODEL_LEN)


def num_parameters(config: ModelConfig) -> int:
    """Parameter count of a config (embedding and lm_head included)."""
    import torch

    from splitserve.model.llama import CausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(config).parameters())
