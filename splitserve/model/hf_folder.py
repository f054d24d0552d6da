"""Read a Hugging Face model folder without its weights: config.json, tokenizer and generation settings.

No torch (the router uses it through :func:`splitserve.model.info.load_model_info`); the safetensors
weights are read by :mod:`splitserve.model.loader_hf`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from splitserve.model.config import ModelParts, config_from_hf, sliding_window_of
from splitserve.dtypes import hf_checkpoint_dtype, resolve_dtype
from splitserve.model.tokenizer import Tokenizer, backend_adds_bos, token_content


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _opt_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    tmpl = tok_cfg.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if not tmpl and (folder / "chat_template.jinja").is_file():
        tmpl = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not tmpl and (folder / "chat_template.json").is_file():
        tmpl = read_json(folder / "chat_template.json").get("chat_template")
    return tmpl or None


def load_tokenizer(folder: Path, model_cfg: dict[str, Any], extra_eos: list[int]) -> Tokenizer:
    """Tokenizer from tokenizer.json plus tokenizer_config.json / special_tokens_map.json.

    Raises:
        FileNotFoundError: no tokenizer.json.
    """
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
    hf = tokenizers.Tokenizer.from_file(str(tj))
    tok_cfg = _opt_json(folder / "tokenizer_config.json")
    smap = _opt_json(folder / "special_tokens_map.json")

    def special(name: str) -> str | None:
        if name in tok_cfg and tok_cfg[name] is None:  # explicitly none (e.g. Qwen's bos_token: null)
            return None
        s = token_content(tok_cfg.get(name)) or token_content(smap.get(name))
        if s is None and model_cfg.get(f"{name}_id") is not None:
            ids = _as_ids(model_cfg[f"{name}_id"])
            added = hf.get_added_tokens_decoder()
            s = (added[ids[0]].content if ids[0] in added else hf.id_to_token(ids[0])) if ids else None
        return s

    bos, eos = special("bos_token"), special("eos_token")
    bos_id = hf.token_to_id(bos) if bos else None
    add_bos = tok_cfg["add_bos_token"] if "add_bos_token" in tok_cfg else backend_adds_bos(hf, bos_id)
    return Tokenizer(
        hf,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=bool(add_bos),
        chat_template=_chat_template(folder, tok_cfg),
        extra_eos_token_ids=tuple(extra_eos),
    )


def read_hf_folder(folder: Path, dtype: str = "float32") -> ModelParts:
    """Config, tokenizer, EOS ids and context length of a HF model folder; ``state_dict`` is empty.

    Raises:
        FileNotFoundError: config.json or tokenizer.json missing.
        ValueError: malformed files.
        NotImplementedError: unsupported architecture / features.
    """
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder: no config.json")
    raw = read_json(cfg_path)
    config = config_from_hf(raw, resolve_dtype(dtype, hf_checkpoint_dtype(raw)))  # "auto": config.json's torch_dtype
    gen = _opt_json(folder / "generation_config.json")
    eos_ids = _as_ids(gen.get("eos_token_id")) or _as_ids(raw.get("eos_token_id"))
    tok = load_tokenizer(folder, raw, eos_ids)
    eos_ids = eos_ids or list(tok.eos_token_ids)
    window = sliding_window_of(raw)
    max_len = config.max_position_embeddings if window is None else min(window, config.max_position_embeddings)
    return ModelParts(config, {}, tok, tuple(dict.fromkeys(eos_ids)), max_len)
