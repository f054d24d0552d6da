"""Llama-family model math over a paged KV cache, plus HF/GGUF loaders.

Public API: ``load_model``, ``LoadedModel``, ``load_model_info``, ``ModelInfo``, ``ModelConfig``,
``Tokenizer``, ``AttentionMetadata``. Each name is imported on first use (PEP 562), so importing this
package, or the torch-free ``load_model_info`` / ``ModelConfig`` / ``Tokenizer``, does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.lazy import lazy_exports

_EXPORTS = {
    "AttentionMetadata": "splitserve.model.attention",
    "LoadedModel": "splitserve.model.loader",
    "load_model": "splitserve.model.loader",
    "ModelInfo": "splitserve.model.info",
    "load_model_info": "splitserve.model.info",
    "ModelConfig": "splitserve.model.config",
    "Tokenizer": "splitserve.model.tokenizer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from splitserve.model.attention import AttentionMetadata
    from splitserve.model.config import ModelConfig
    from splitserve.model.info import ModelInfo, load_model_info
    from splitserve.model.loader import LoadedModel, load_model
    from splitserve.model.tokenizer import Tokenizer


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
