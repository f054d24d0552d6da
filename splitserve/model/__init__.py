"""Llama-family model math over a paged KV cache, plus HF/GGUF loaders.

Public API: ``load_model``, ``LoadedModel``, ``ModelConfig``, ``Tokenizer``, ``AttentionMetadata``.
"""

from splitserve.model.attention import AttentionMetadata
from splitserve.model.config import ModelConfig
from splitserve.model.loader import LoadedModel, load_model
from splitserve.model.tokenizer import Tokenizer

__all__ = ["AttentionMetadata", "LoadedModel", "ModelConfig", "Tokenizer", "load_model"]
