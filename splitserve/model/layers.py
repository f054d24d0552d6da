"""Small building blocks: RMSNorm and the SwiGLU MLP (parameter names match Hugging Face)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 then cast back (as HF Llama does).

    x: ``[..., dim]`` -> ``[..., dim]`` in x's dtype.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; x: ``[T, hidden]`` -> ``[T, hidden]``."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
