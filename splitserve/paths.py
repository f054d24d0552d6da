"""Where the project's shipped files live."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "models"


def default_model_path() -> Path:
    """The embedded default model (TinyStories-656K, Apache-2.0; see models/SOURCES.md)."""
    return MODELS_DIR / "TinyStories-656K"
