"""Rotary position embedding, HF "rotate-half" layout (first half of head_dim pairs with second half)."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies, float32 ``[head_dim // 2]`` (radians per position).

    ``scaling`` is a canonical rope scaling dict (see ``config.normalize_rope_scaling``):
    "linear" divides all frequencies by ``factor``; "llama3" applies Llama 3.1's wavelength-banded
    scaling (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).

    Raises:
        NotImplementedError: unknown rope type.
        ValueError: a required scaling parameter is missing.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", "default")
    try:
        if kind == "default":
            return inv_freq
        if kind == "linear":
            return inv_freq / float(scaling["factor"])
        if kind == "llama3":
            return _llama3(inv_freq, scaling)
    except KeyError as e:
        raise ValueError(f"rope_scaling {kind!r} is missing parameter {e.args[0]!r}") from None
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for arbitrary positions.

    ``inv_freq`` is a float32 non-persistent buffer so ``.to(device)`` moves it. ``cos_sin`` reads a
    table of every position below the longest seen so far (grown by doubling, kept per dtype).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int ``[T]``, all below ``max_position`` -> (cos, signed_sin), each ``[T, 1, head_dim]`` in
        ``dtype``: ``forward``'s values (computed in float32, then cast) with the first half of sin negated,
        the form ``apply_rope_`` takes."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < max_position:
            n = max(256, 1 << (max_position - 1).bit_length())
            cos, sin = self.forward(torch.arange(n, device=self.inv_freq.device), dtype)
            half = sin.shape[-1] // 2
            table = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
            self._tables[dtype] = table
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int ``[T]`` -> (cos, sin), each ``[T, head_dim]`` in ``dtype`` (computed in float32)."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate x ``[T, H, D]`` in place (a view into the fused qkv output); cos/signed_sin: ``[T, 1, D]`` from
    ``RotaryEmbedding.cos_sin`` (sin with its first half negated). ``x * cos + roll(x, D/2) * signed_sin`` is
    bit-identical to ``apply_rope``'s ``x * cos + rotate_half(x) * sin`` in three torch calls instead of six."""
    rot = x.roll(x.shape[-1] // 2, -1)
    x.mul_(cos).addcmul_(rot, signed_sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, H, D]``; cos/sin: ``[T, D]`` -> rotated x ``[T, H, D]``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
