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

    Built with HF's ``gate_proj``/``up_proj``/``down_proj`` (so HF and GGUF weights load by name); ``fuse``
    then replaces them with ``gate_up_proj`` (gate columns, then up columns) and ``down_proj`` as
    TransposedLinear.
    """

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.intermediate = intermediate
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def fuse(self) -> None:
        """One gate/up GEMM per step instead of two; weights stored transposed (see TransposedLinear)."""
        self.gate_up_proj = TransposedLinear.of(self.gate_proj, self.up_proj)
        self.down_proj = TransposedLinear.of(self.down_proj)
        del self.gate_proj, self.up_proj

    def forward_add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)`` after ``fuse``: ``[T, hidden]`` each."""
        gu = torch.mm(x, self.gate_up_proj.weight_t)  # [T, 2 * intermediate]
        act = F.silu(gu[:, : self.intermediate], inplace=True).mul_(gu[:, self.intermediate :])
        return torch.addmm(residual, act, self.down_proj.weight_t)


class TransposedLinear(nn.Module):
    """``y = x @ weight_t + bias``; ``weight_t`` is ``[in, out]``.

    float32 weights are stored transposed (``weight_t`` contiguous): measured on this project's 2-core AVX2
    machine (MKL sgemm, 1 thread, torch 2.13), the decode GEMVs of a 25M Llama ran ~25% faster so than as
    ``F.linear(x, W)``. bfloat16/float16 weights keep HF's ``[out, in]`` storage (``weight_t`` is its
    transposed view): without AVX512-BF16/AMX, torch's reduced-precision GEMM was ~6x slower on a
    contiguous ``[in, out]`` operand. ``weight`` is the HF-shaped ``[out, in]`` view.
    """

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of(cls, *parts: nn.Linear) -> "TransposedLinear":
        """One layer whose outputs are ``parts``' outputs in order (weights and biases concatenated)."""
        w = torch.cat([p.weight for p in parts]) if len(parts) > 1 else parts[0].weight
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(w.t().contiguous() if w.dtype == torch.float32 else w.t(), bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
