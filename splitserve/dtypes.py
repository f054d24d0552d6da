"""Tensor dtypes by name, without torch: what a config or a KV layout may say, and its size in bytes.

Value types (``ModelConfig``, ``KVLayout``) and the control plane (router, store master) work with
these names only; the code that allocates tensors turns a name into a ``torch.dtype`` with
:func:`splitserve.transfer.kv_cache.torch_dtype`.
"""

from __future__ import annotations

#: dtype name (torch's spelling) -> bytes per element
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}

#: dtypes a model's weights and KV cache may have (``--dtype``)
MODEL_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``.

    Raises:
        ValueError: ``dtype`` is not in :data:`DTYPE_ITEMSIZE` (the message lists the known names).
    """
    try:
        return DTYPE_ITEMSIZE[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_ITEMSIZE))}") from None


def check_model_dtype(dtype: str) -> str:
    """``dtype`` itself if a model may use it, else ValueError listing :data:`MODEL_DTYPES`."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(MODEL_DTYPES)}")
    return dtype
