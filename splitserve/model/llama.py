"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameter names match Hugging Face (``model.layers.N.self_attn.q_proj.weight`` ...), so a HF state
dict loads directly. ``build_model`` constructs the module on the meta device and assigns the
loaded tensors, so nothing is randomly initialised; it then fuses q/k/v into ``qkv_proj`` and gate/up
into ``gate_up_proj``. The forward is plain ``torch``/``F`` calls per layer (no submodule calls): RMSNorm,
one QKV GEMM, RoPE in place, paged attention, o_proj + residual in one ``addmm``, one gate/up GEMM,
SiLU * up in place, down_proj + residual in one ``addmm``. On the CPU (AVX2) every model runs the projections on
splitserve's packed GEMM and the norms, SiLU * up and RoPE + K/V store on its layer kernels
(:mod:`splitserve.kernels`), one call each. Activations are then float32 whatever ``--dtype`` says: bfloat16 and
float16 set how weights and the KV cache are stored (half the bytes a decode step reads and a KV block moves), and
they are widened to float32 as the kernels read them (weight-only reduced precision: CPUs without bf16/fp16
arithmetic, such as AVX2 ones, would otherwise run torch's emulated 16-bit GEMMs, ~10x slower here).
"""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as F

from splitserve.kernels import build as kernels_build
from splitserve.kernels import cpu_gemm, layer_ops
from splitserve.kernels.decoder_layer import LayerWeights, decoder_layer
from splitserve.model.attention import AttentionMetadata, AttentionPlan, paged_attention, plan_attention
from splitserve.model.attention_ref import reference_attention
from splitserve.model.attention_static import StaticDecodePlan, static_decode_attention
from splitserve.model.config import ModelConfig
from splitserve.model.layers import RMSNorm, SwiGLUMLP, TransposedLinear
from splitserve.model.rope import RotaryEmbedding, apply_rope_
from splitserve.transfer.kv_cache import torch_dtype


class Attention(nn.Module):
    """Self-attention. Built with HF's q/k/v/o_proj (weights load by name); ``fuse`` replaces q/k/v with one
    ``qkv_proj`` (outputs: q, k, v heads in order) and o_proj with a TransposedLinear."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dt, h, d = torch_dtype(cfg.dtype), cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias, dtype=dt)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias, dtype=dt)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias, dtype=dt)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_proj_bias, dtype=dt)
        self.qkv_proj: nn.Linear | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        else:
            self.q_norm = self.k_norm = None

    def fuse(self) -> None:
        """Concatenate q/k/v_proj into qkv_proj (one GEMM per step instead of three)."""
        self.qkv_proj = TransposedLinear.of(self.q_proj, self.k_proj, self.v_proj)
        self.o_proj = TransposedLinear.of(self.o_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward_add(self, h, x, cos, sin, kv_cache, layer, plan, attn):
        """``h + attention(x)``: h, x ``[T, hidden]``; writes this layer's K/V into ``kv_cache``.
        ``plan`` (from plan_attention) selects the block-gather path, a StaticDecodePlan the fixed-shape decode path
        (CUDA graphs); None the reference path over ``attn``."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x).view(t, hq + 2 * hkv, d)
        if self.q_norm is not None:
            eps = self.q_norm.eps
            qkv[:, :hq] = F.rms_norm(qkv[:, :hq], (d,), self.q_norm.weight, eps)
            qkv[:, hq : hq + hkv] = F.rms_norm(qkv[:, hq : hq + hkv], (d,), self.k_norm.weight, eps)
        if isinstance(plan, AttentionPlan) and plan.cpu_kv_write:  # RoPE and the K/V store in one kernel call
            layer_ops.rope_write_kv(qkv, cos, sin, kv_cache, layer, plan.write_blocks, plan.write_offsets, hkv)
            return self.o_proj.forward_add(h, paged_attention(qkv, kv_cache, layer, plan, hq, hkv, kv_written=True))
        apply_rope_(qkv[:, : hq + hkv], cos, sin)
        if plan is None:
            o = reference_attention(qkv, kv_cache, layer, attn, hq, hkv)
        elif isinstance(plan, StaticDecodePlan):
            o = static_decode_attention(qkv, kv_cache, layer, plan, hq, hkv)
        else:
            o = paged_attention(qkv, kv_cache, layer, plan, hq, hkv)
        return self.o_proj.forward_add(h, o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, torch_dtype(cfg.dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch_dtype(cfg.dtype))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch_dtype(cfg.dtype))
        self.norm_shape = (cfg.hidden_size,)
        self.cpu_layer_ops = False  # CausalLM.pack_for_cpu: norms on splitserve's CPU kernel
        self.fused: LayerWeights | None = None  # CausalLM.pack_for_cpu: decode-only steps run the layer as one call

    def fused_weights(self) -> LayerWeights | None:
        """The packed weights for :func:`~splitserve.kernels.decoder_layer.decoder_layer` (after ``pack_for_cpu``);
        None for layers with q/k norms (Qwen3), which run the Python layer."""
        a, m = self.self_attn, self.mlp
        if a.q_norm is not None:
            return None
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        return LayerWeights(n1.weight, n2.weight, n1.eps, a.qkv_proj.packed, a.qkv_proj.bias, a.o_proj.packed,
                            a.o_proj.bias, m.gate_up_proj.packed, m.down_proj.packed, a.num_heads, a.num_kv_heads,
                            a.head_dim, m.intermediate)

    def norm(self, x: torch.Tensor, n: RMSNorm) -> torch.Tensor:
        if self.cpu_layer_ops:
            return layer_ops.rms_norm(x, n.weight, n.eps)
        return F.rms_norm(x, self.norm_shape, n.weight, n.eps)

    def forward(self, h, cos, sin, kv_cache, layer, plan, attn=None):
        """h: ``[T, hidden]`` -> ``[T, hidden]`` (plain torch calls, no submodule __call__)."""
        h = self.self_attn.forward_add(h, self.norm(h, self.input_layernorm), cos, sin, kv_cache, layer, plan, attn)
        return self.mlp.forward_add(h, self.norm(h, self.post_attention_layernorm))


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=torch_dtype(cfg.dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch_dtype(cfg.dtype))


class CausalLM(nn.Module):
    """The full model. Call ``model(input_ids, positions, kv_cache, attn)``.

    Attributes:
        reference_attention: False (default): block-gather paged attention (``attention.py``); True: the
            per-token reference path (``attention_ref.py``), for tests.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=torch_dtype(cfg.dtype))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.reference_attention = False
        self.register_buffer("lm_head_packed", None, persistent=False)  # pack_for_cpu: the lm_head's panels
        self.activation_dtype = torch_dtype(cfg.dtype)  # of the hidden states; float32 once pack_for_cpu ran

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up projections in place (after the HF-named weights are loaded)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def pack_for_cpu(self) -> None:
        """Pack every projection (and the lm_head, as a copy beside its weight, unless a float32 one is tied to the
        embedding) for splitserve's CPU GEMM kernel (:mod:`splitserve.kernels.cpu_gemm`) and run the norms and
        SiLU * up on its layer kernels (:mod:`splitserve.kernels.layer_ops`); after ``fuse_projections``, CPU weights.
        Activations become float32 (``activation_dtype``): norm weights are widened to float32, 16-bit projection
        weights stay 16-bit in their panels."""
        for layer in self.model.layers:
            layer.cpu_layer_ops = True
            attn = layer.self_attn
            for proj in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                proj.pack_for_cpu()
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm):
                if norm is not None:
                    norm.weight = nn.Parameter(norm.weight.float(), requires_grad=False)
        self.model.norm.weight = nn.Parameter(self.model.norm.weight.float(), requires_grad=False)
        for layer in self.model.layers:
            layer.fused = layer.fused_weights()
        if not self.config.tie_word_embeddings or self.lm_head.weight.dtype != torch.float32:
            self.lm_head_packed = cpu_gemm.pack(self.lm_head.weight)
        self.activation_dtype = torch.float32

    @property
    def packed_for_cpu(self) -> bool:
        """pack_for_cpu ran: the projections run on splitserve's CPU GEMM kernel."""
        layers = self.model.layers
        return bool(layers) and layers[0].self_attn.qkv_proj is not None and layers[0].self_attn.qkv_proj.packed is not None

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last RMSNorm: ``[R, hidden]`` -> ``[R, hidden]``."""
        n = self.model.norm
        if self.packed_for_cpu:
            return layer_ops.rms_norm(h, n.weight, n.eps)
        return F.rms_norm(h, (self.config.hidden_size,), n.weight, n.eps)

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, vocab_size]`` logits of final-normed hidden states ``last`` ``[R, hidden]``."""
        if self.lm_head_packed is not None:
            return cpu_gemm.packed_gemm(last, self.lm_head_packed, self.config.vocab_size)
        return F.linear(last, self.lm_head.weight).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        """``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        c = self.config
        return (num_blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Zeroed KV cache of ``kv_cache_shape(...)`` in the model dtype."""
        dev = device if device is not None else self.lm_head.weight.device
        return torch.zeros(self.kv_cache_shape(num_blocks, block_size), dtype=torch_dtype(self.config.dtype), device=dev)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the packed new tokens of one or more sequences.

        Args:
            input_ids: int64 ``[T]`` new tokens, sequences concatenated in ``attn`` order.
            positions: int64 ``[T]`` absolute position of each token (RoPE), normally
                ``seq_len - query_len + i`` for the i-th new token of a sequence.
            kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the model
                dtype; updated in place.
            attn: where to write and what to attend to (see AttentionMetadata).
            logits_indices: int64 ``[R]`` indices into the T new tokens whose logits to return (e.g. every
                prompt position of a request asking for prompt logprobs); None: each sequence's last token.
        Returns:
            float32 ``[num_seqs, vocab_size]`` logits of each sequence's last new token, or ``[R, vocab_size]``
            with ``logits_indices``.
        Raises:
            ValueError: bad shapes, dtype/device mismatch, or inconsistent metadata.
        """
        c = self.config
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be 1-D [T]; got {tuple(input_ids.shape)} and {tuple(positions.shape)}")
        want = self.kv_cache_shape(kv_cache.shape[0], kv_cache.shape[3]) if kv_cache.dim() == 6 else None
        if want is None or tuple(kv_cache.shape) != want:
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not match model layout {want or '(6-D)'}")
        if kv_cache.dtype != torch_dtype(c.dtype):
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} != model dtype {torch_dtype(c.dtype)}")
        dev = self.lm_head.weight.device
        if kv_cache.device != dev:
            raise ValueError(f"kv_cache is on {kv_cache.device} but the model is on {dev}")
        input_ids, positions = input_ids.to(dev), positions.to(dev)
        plan = plan_attention(attn, input_ids.shape[0], kv_cache, self.activation_dtype)
        h = F.embedding(input_ids, self.model.embed_tokens.weight).to(self.activation_dtype)
        cos, sin = self.rotary.cos_sin(positions, max(attn.seq_lens), h.dtype)
        ref = self.reference_attention
        ip = plan.in_place_decode
        if not ref and ip is not None and ip.tokens is None and self.model.layers[0].fused is not None:
            t = input_ids.shape[0]  # a decode-only step on the CPU kernels: one call per layer
            cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
            for i, layer in enumerate(self.model.layers):
                h = decoder_layer(h, layer.fused, cos, sin, kv_cache, i, plan.write_blocks, plan.write_offsets,
                                  ip.block_tables, ip.seq_lens)
                if attn.on_layer_done is not None:
                    attn.on_layer_done(i)
        else:
            for i, layer in enumerate(self.model.layers):
                h = layer.forward(h, cos, sin, kv_cache, i, None if ref else plan, attn)
                if attn.on_layer_done is not None:
                    attn.on_layer_done(i)
        if logits_indices is not None:
            h = h[logits_indices.to(dev)]
        elif plan.last_token_index is not None:
            h = h[plan.last_token_index]
        return self.logits(self.final_norm(h))


    @torch.no_grad()
    def forward_decode_static(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                              plan: StaticDecodePlan, max_position: int) -> torch.Tensor:
        """One fixed-shape decode step (what a CUDA graph captures): no validation, no host sync.

        Args:
            input_ids, positions: int64 ``[B]`` on the model's device.
            kv_cache: as ``forward``; updated in place.
            plan: from :func:`~splitserve.model.attention_static.static_decode_plan`.
            max_position: an upper bound of ``positions`` + 1 (the RoPE table must already hold it, or it grows).
        Returns:
            float32 ``[B, vocab_size]`` logits.
        """
        h = F.embedding(input_ids, self.model.embed_tokens.weight).to(self.activation_dtype)
        cos, sin = self.rotary.cos_sin(positions, max_position, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = layer.forward(h, cos, sin, kv_cache, i, plan)
        return self.logits(self.final_norm(h))


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], device: str = "cpu") -> CausalLM:
    """Create a CausalLM in eval mode from HF-named tensors (converted to ``cfg.dtype``, then moved to ``device``).

    Tied models may provide either ``model.embed_tokens.weight`` or ``lm_head.weight``; both then
    share one tensor. ``model.rotary_emb.*`` / ``*.rotary_emb.inv_freq`` entries are ignored.

    Raises:
        ValueError: missing or unexpected tensors, or shape mismatches (names listed).
    """
    sd = {k: v for k, v in state_dict.items() if "rotary_emb." not in k}
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    if cfg.tie_word_embeddings:
        src = sd.get(emb, sd.get(head))
        if src is None:
            raise ValueError(f"tied model has neither {emb!r} nor {head!r}")
        sd[emb] = sd[head] = src
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weights do not match config: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, p in expected.items():
        if tuple(sd[name].shape) != tuple(p.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(sd[name].shape)}, config expects {tuple(p.shape)}")
    model.load_state_dict({k: v.to(torch_dtype(cfg.dtype)).contiguous() for k, v in sd.items() if k != head or not cfg.tie_word_embeddings},
                          strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    model.fuse_projections()
    if device == "cpu" and kernels_build.load() is not None:
        model.pack_for_cpu()
    if device != "cpu":  # cast on the host (half the bytes for 16-bit dtypes), then one move; tied weights stay one
        model.to(device)
    return model.eval().requires_grad_(False)
