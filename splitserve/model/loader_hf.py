"""Load a Hugging Face model folder with its weights: *.safetensors (single or sharded) plus
everything :func:`splitserve.model.hf_folder.read_hf_folder` reads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from splitserve.model.config import ModelParts
from splitserve.model.hf_folder import read_hf_folder, read_json


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [folder / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent or not files:
            raise FileNotFoundError(f"{index} lists missing shard files: {absent or 'none listed'}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ValueError(f"{folder} has only pickle checkpoints (*.bin/*.pt); only safetensors weights are supported")
    raise FileNotFoundError(f"no *.safetensors weights in {folder}")


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors file(s), keyed by HF name."""
    sd: dict[str, torch.Tensor] = {}
    for f in _weight_files(folder):
        sd.update(load_file(str(f), device="cpu"))
    return sd


def load_hf_folder(folder: Path, dtype: str = "float32", *, weights: bool = True) -> ModelParts:
    """Read a HF model folder (``weights=False``: no tensors, ``state_dict`` empty).

    Raises:
        FileNotFoundError: config.json, weights or tokenizer.json missing.
        ValueError: malformed files.
        NotImplementedError: unsupported architecture / features.
    """
    parts = read_hf_folder(folder, dtype)
    return parts._replace(state_dict=load_state_dict(folder)) if weights else parts
