"""What a running endpoint serves (``GET /v1/models``), and the local model whose tokenizer builds its prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from splitserve.paths import MODELS_DIR


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The endpoint's model: ``name`` (the request's ``model``) and its context (tokens; None if not reported)."""

    name: str
    max_model_len: int | None


class EndpointError(RuntimeError):
    """The endpoint cannot be asked what it serves (unreachable, not OpenAI-compatible); the message says which."""


def served_model(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> ServedModel:
    """The first model of ``GET {url}/v1/models``.

    Raises:
        EndpointError: connection refused or timed out, a non-200 answer, or no model listed.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s, headers=headers)
    except httpx.HTTPError as exc:
        raise EndpointError(f"cannot reach {url}: {type(exc).__name__}: {exc} (is the server up? `splitserve up`)") from None
    if resp.status_code != 200:
        raise EndpointError(f"GET {url}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        card = resp.json()["data"][0]
        return ServedModel(str(card["id"]), card.get("max_model_len"))
    except (ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(f"GET {url}/v1/models lists no model: {resp.text[:200]}") from None


def local_model_for(name: str, models_dir: Path = MODELS_DIR) -> Path | None:
    """The shipped model (a folder or ``NAME.gguf`` in ``models_dir``) that an endpoint serves as ``name``, if any."""
    for candidate in (models_dir / name, models_dir / f"{name}.gguf"):
        if candidate.exists():
            return candidate
    return None
