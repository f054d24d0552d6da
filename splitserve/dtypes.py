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


#: ``--dtype`` choices: a model dtype, or "auto" = the checkpoint's dtype (vLLM's rule)
DTYPE_CHOICES: tuple[str, ...] = ("auto", *MODEL_DTYPES)


def check_model_dtype(dtype: str) -> str:
    """``dtype`` itself if a model may run in it, else ValueError listing :data:`MODEL_DTYPES`."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(MODEL_DTYPES)}")
    return dtype


def check_dtype_choice(dtype: str) -> str:
    """``dtype`` itself if ``--dtype`` may say it (a model dtype or "auto"), else ValueError listing the choices."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPE_CHOICES)}")
    return dtype


def resolve_dtype(dtype: str, checkpoint_dtype: str) -> str:
    """The weights/KV dtype to run: ``dtype``, or ``checkpoint_dtype`` when ``dtype`` is "auto".

    Raises:
        ValueError: ``dtype`` is not one of :data:`DTYPE_CHOICES`.
    """
    check_dtype_choice(dtype)
    return checkpoint_dtype if dtype == "auto" else dtype


def hf_checkpoint_dtype(cfg: dict) -> str:
    """The dtype a HF ``config.json`` declares (``torch_dtype``; transformers 5: ``dtype``); float32 when absent
    or not one of float32/float16/bfloat16 (e.g. float64)."""
    value = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    value = {"float": "float32", "half": "float16"}.get(value, value)
    return value if value in MODEL_DTYPES else "float32"
