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
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; x: ``[T, hidden]`` -> ``[T, hidden]``.

    Built with HF's ``gate_proj``/``up_proj`` (so HF and GGUF weights load by name); ``fuse`` then
    replaces them with one ``gate_up_proj`` (``[2 * intermediate, hidden]``: gate rows, then up rows).
    """

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.intermediate = intermediate
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """Concatenate gate_proj and up_proj into gate_up_proj (one GEMM per step instead of two)."""
        self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward_add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)`` with the fused projection: ``[T, hidden]`` each."""
        gu = F.linear(x, self.gate_up_proj.weight)  # [T, 2 * intermediate]
        act = F.silu(gu[:, : self.intermediate], inplace=True).mul_(gu[:, self.intermediate :])
        return torch.addmm(residual, act, self.down_proj.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_add(torch.zeros_like(x), x)


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output rows are ``parts``' rows in order (biases concatenated likewise)."""
    w = torch.cat([p.weight for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta", dtype=w.dtype)
    fused.weight = nn.Parameter(w, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused
