"""splitserve's CPU kernels over 16-bit weights and KV caches (bfloat16, float16; widened to float32 as they are read)
against torch on the widened values, and the one-call decoder layer (cpu_decoder_layer.cpp) against the Python layer,
bit for bit, in every dtype. A 16-bit row's independence of its batch is tested with float32's in test_cpu_kernels.py."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import build, cpu_gemm, layer_ops, paged_decode
from splitserve.model import AttentionMetadata, load_model
from splitserve.model.rope import RotaryEmbedding, apply_rope_

pytestmark = pytest.mark.skipif(not build.enabled(), reason="no AVX2 on this CPU (or PD_CPU_KERNELS=0)")

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,k", [(50, 37), (1024, 512), (16, 300)])
def test_packed_gemm_of_16_bit_weights_equals_float32_math_on_the_widened_weights(dtype, n, k):
    """Every row count: register-tile streaming (<= 6 rows) and the widened 128-k pieces (> 6 rows, K across pieces)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    packed = cpu_gemm.pack(w)
    assert packed.dtype == dtype and torch.equal(cpu_gemm.unpack(packed, n), w)
    wide = w.float()
    for m in (1, 2, 6, 7, 13, 64, 130):
        x, residual = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
        out = cpu_gemm.packed_gemm(x, packed, n, residual)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, residual + x @ wide.t(), rtol=1e-4, atol=1e-4)


def test_packed_gemm_refuses_other_weight_dtypes():
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        cpu_gemm.packed_gemm(torch.randn(2, 8), cpu_gemm.pack(torch.randn(32, 8, dtype=torch.float64)), 32)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 64), (6, 1, 12)])
def test_paged_decode_attention_over_a_16_bit_cache_equals_sdpa_on_the_widened_cache(dtype, hq, hkv, d):
    """GQA, head_dim not a multiple of 8, contexts at and across block boundaries."""
    bs, layers, layer = 4, 2, 1
    g = torch.Generator().manual_seed(hq + d)
    cache = torch.randn(32, layers, 2, bs, hkv, d, generator=g).to(dtype)
    lens = [1, bs, bs + 1, 13]
    m = max(-(-n // bs) for n in lens)
    ids = torch.randperm(32, generator=g).tolist()
    tables = [ids[i * m : (i + 1) * m] for i in range(len(lens))]
    q = torch.randn(len(lens), hq, d, generator=g)
    got = paged_decode.paged_decode_attention(q, cache, layer, torch.tensor(tables), torch.tensor(lens))
    wide = cache.float()
    for b, n in enumerate(lens):
        k = wide[tables[b], layer, 0].reshape(-1, hkv, d)[:n].transpose(0, 1)
        v = wide[tables[b], layer, 1].reshape(-1, hkv, d)[:n].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF)
def test_rope_write_kv_stores_torch_rounded_k_v_and_hands_back_the_rounded_values(dtype):
    t, hq, hkv, d, bs, layer = 9, 4, 2, 16, 4, 1
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g)
    cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.arange(t) * 7, 64, torch.float32)
    slots = torch.randperm(6 * bs, generator=g)[:t]
    want = qkv.clone()
    apply_rope_(want[:, : hq + hkv], cos, sin)
    rounded = want[:, hq:].to(dtype)  # torch's float32 -> 16-bit conversion (round to nearest even)
    cache = torch.zeros(6, 2, 2, bs, hkv, d, dtype=dtype)
    layer_ops.rope_write_kv(qkv, cos, sin, cache, layer, slots // bs, slots % bs, hkv)
    assert torch.equal(cache[:, layer][slots // bs, :, slots % bs], rounded.view(t, 2, hkv, d))
    torch.testing.assert_close(qkv[:, :hq], want[:, :hq], rtol=1e-6, atol=1e-6)  # q: rotated, not rounded
    assert torch.equal(qkv[:, hq:], rounded.float())  # k, v: what later steps read from the cache
    assert cache[:, 0].abs().sum() == 0


def _prompt_then_decodes(lm) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of two prompts (20 tokens over two blocks, 5 tokens) and of 14 decode steps of both together (the first
    crosses into a third block), and the KV cache after them."""
    cache = lm.model.allocate_kv_cache(8, 16)
    t1, t2 = [0, 1, 2], [4, 5]
    out = [lm.model(torch.arange(3, 23), torch.arange(20), cache, AttentionMetadata(torch.arange(20), [20], [20], [t1[:2]], 16)),
           lm.model(torch.arange(30, 35), torch.arange(5), cache, AttentionMetadata(torch.arange(64, 69), [5], [5], [t2[:1]], 16))]
    for step in range(14):
        p1, p2 = 20 + step, 5 + step
        slots = torch.tensor([t1[p1 // 16] * 16 + p1 % 16, t2[p2 // 16] * 16 + p2 % 16])
        meta = AttentionMetadata(slots, [1, 1], [p1 + 1, p2 + 1], [t1, t2], 16)
        out.append(lm.model(torch.tensor([7 + step, 9 + step]), torch.tensor([p1, p2]), cache, meta))
    return out, cache


@pytest.mark.parametrize("model", ["synthetic:llama-tiny", "TinyStories-656K"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_one_call_decoder_layer_equals_the_python_layer_bit_for_bit(model, dtype, monkeypatch):
    from splitserve.model import llama
    from splitserve.paths import REPO_ROOT

    lm = load_model(model if model.startswith("synthetic:") else REPO_ROOT / "models" / model, dtype=dtype)
    layers = lm.model.model.layers
    fused = [layer.fused for layer in layers]
    assert all(f is not None for f in fused)
    calls = []
    real = llama.decoder_layer
    monkeypatch.setattr(llama, "decoder_layer", lambda *a: calls.append(a[5]) or real(*a))
    one_call, cache_one_call = _prompt_then_decodes(lm)
    assert calls == list(range(len(layers))) * 14  # every decode step, every layer; never the two prompts
    for layer in layers:
        layer.fused = None
    python, cache_python = _prompt_then_decodes(lm)
    assert len(calls) == 14 * len(layers)
    for layer, f in zip(layers, fused):
        layer.fused = f
    assert all(torch.equal(a, b) for a, b in zip(one_call, python))
    assert torch.equal(cache_one_call, cache_python)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_models_on_the_kernels_agree_with_float32_more_closely_than_torchs_16_bit_path(dtype, monkeypatch):
    """Same greedy tokens as float32 here, and logits nearer float32's than torch's all-16-bit path (PD_CPU_KERNELS=0)."""
    from splitserve.paths import REPO_ROOT

    path = REPO_ROOT / "models" / "TinyStories-656K"
    want, _ = _prompt_then_decodes(load_model(path))
    got, _ = _prompt_then_decodes(load_model(path, dtype=dtype))
    monkeypatch.setenv("PD_CPU_KERNELS", "0")
    torch_16, _ = _prompt_then_decodes(load_model(path, dtype=dtype))
    for a, t, w in zip(got, torch_16, want):
        assert torch.equal(a.argmax(-1), w.argmax(-1))
        assert (a - w).abs().max() <= (t.float() - w).abs().max()
