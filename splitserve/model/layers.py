"""Small building blocks: RMSNorm and the SwiGLU MLP (parameter names match Hugging Face)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels import cpu_gemm, layer_ops


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
        gu = self.gate_up_proj.forward(x)  # [T, 2 * intermediate]
        if self.gate_up_proj.packed is not None:  # on splitserve's CPU kernels: one call, a contiguous [T, intermediate]
            act = layer_ops.silu_mul(gu)
        else:
            act = F.silu(gu[:, : self.intermediate], inplace=True).mul_(gu[:, self.intermediate :])
        return self.down_proj.forward_add(residual, act)


class TransposedLinear(nn.Module):
    """``y = x @ weight_t + bias``; ``weight_t`` is ``[in, out]``.

    float32 weights are stored transposed (``weight_t`` contiguous): measured on this project's 2-core AVX2
    machine (MKL sgemm, 1 thread, torch 2.13), the decode GEMVs of a 25M Llama ran ~25% faster so than as
    ``F.linear(x, W)``. bfloat16/float16 weights keep HF's ``[out, in]`` storage (``weight_t`` is its
    transposed view): without AVX512-BF16/AMX, torch's reduced-precision GEMM was ~6x slower on a
    contiguous ``[in, out]`` operand. ``weight`` is the HF-shaped ``[out, in]`` view (a copy once packed).

    :meth:`pack_for_cpu` replaces ``weight_t`` by ``packed``, 16-column panels ``[ceil(out/16), in, 16]`` in the
    weight's dtype that splitserve's CPU GEMM kernel streams (:mod:`splitserve.kernels.cpu_gemm`; on the CPU only);
    its inputs and outputs are then float32 whatever the weight's dtype (the bias is kept in float32).
    """

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight_t: nn.Parameter | None = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed: nn.Parameter | None = None
        self.out_features = weight_t.shape[1]

    @classmethod
    def of(cls, *parts: nn.Linear) -> "TransposedLinear":
        """One layer whose outputs are ``parts``' outputs in order (weights and biases concatenated)."""
        w = torch.cat([p.weight for p in parts]) if len(parts) > 1 else parts[0].weight
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(w.t().contiguous() if w.dtype == torch.float32 else w.t(), bias)

    def pack_for_cpu(self) -> None:
        """Store the weight as the CPU kernel's panels (CPU weights; the caller checked the kernel loads)."""
        self.packed = nn.Parameter(cpu_gemm.pack(self.weight_t.t()), requires_grad=False)
        self.weight_t = None
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        if self.packed is not None:
            return cpu_gemm.unpack(self.packed, self.out_features)
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out]``."""
        if self.packed is not None:
            out = cpu_gemm.packed_gemm(x, self.packed, self.out_features)
            return out if self.bias is None else out.add_(self.bias)
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)

    def forward_add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight_t + bias``: residual ``[T, out]``, x ``[T, in]`` (one fused call)."""
        if self.packed is not None:
            out = cpu_gemm.packed_gemm(x, self.packed, self.out_features, residual)
        else:
            out = torch.addmm(residual, x, self.weight_t)
        return out if self.bias is None else out.add_(self.bias)
