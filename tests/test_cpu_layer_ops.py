"""splitserve's per-layer CPU kernels (splitserve/kernels/cpu_layer_ops.cpp) against the torch ops they replace:
RMSNorm, SiLU * up, RoPE + the K/V store; and a row's result does not depend on the rows beside it."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import build, layer_ops
from splitserve.model.rope import RotaryEmbedding, apply_rope_

pytestmark = pytest.mark.skipif(not build.enabled(), reason="no AVX2 on this CPU (or PD_CPU_KERNELS=0)")


@pytest.mark.parametrize("k", [1, 7, 64, 513])
def test_rms_norm_equals_torch(k):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(37, k, generator=g) * 3, torch.randn(k, generator=g)
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (k,), w, 1e-6), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer_ops.rms_norm(x.t().contiguous().t(), w, 1e-6), F.rms_norm(x, (k,), w, 1e-6),
                               rtol=1e-5, atol=1e-6)  # a strided x is copied, not misread


@pytest.mark.parametrize("i", [1, 8, 13, 1408])
def test_silu_mul_equals_torch_over_the_whole_range(i):
    g = torch.Generator().manual_seed(i)
    gu = torch.randn(9, 2 * i, generator=g) * 20  # large |gate| of both signs: exp's far ends
    gu[0, 0], gu[-1, 0] = 100.0, -100.0
    want = F.silu(gu[:, :i]) * gu[:, i:]
    got = layer_ops.silu_mul(gu)
    assert got.shape == (9, i) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (6, 1, 16), (2, 2, 12)])
def test_rope_write_kv_equals_torch_rope_and_index_put(hq, hkv, d):
    t, bs, num_blocks, layers, layer = 11, 4, 7, 3, 1
    g = torch.Generator().manual_seed(hq * 100 + d)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g)
    positions = torch.randint(0, 300, (t,), generator=g)
    cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(positions, 300, torch.float32)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    want_qkv = qkv.clone()
    apply_rope_(want_qkv[:, : hq + hkv], cos, sin)
    want_cache = torch.zeros(num_blocks, layers, 2, bs, hkv, d)
    want_cache[:, layer][slots // bs, :, slots % bs] = want_qkv[:, hq:].view(t, 2, hkv, d)
    cache = torch.zeros_like(want_cache)
    layer_ops.rope_write_kv(qkv, cos, sin, cache, layer, slots // bs, slots % bs, hkv)
    torch.testing.assert_close(qkv, want_qkv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, want_cache, rtol=1e-6, atol=1e-6)
    assert cache[:, [0, 2]].abs().sum() == 0  # other layers untouched


def test_rope_write_kv_refuses_slots_outside_the_cache():
    qkv, cos = torch.randn(2, 4, 8), torch.ones(2, 8)
    cache = torch.zeros(3, 1, 2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer_ops.rope_write_kv(qkv, cos, cos, cache, 0, torch.tensor([0, 3]), torch.tensor([0, 1]), 1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer_ops.rope_write_kv(qkv, cos, cos, cache, 0, torch.tensor([0, 1]), torch.tensor([0, 4]), 1)
    with pytest.raises(RuntimeError, match="layer < L"):
        layer_ops.rope_write_kv(qkv, cos, cos, cache, 1, torch.tensor([0, 1]), torch.tensor([0, 1]), 1)
    assert cache.abs().sum() == 0


def test_each_row_is_computed_alone_bitwise_whatever_the_threads():
    """A token's norm, activation and rotation are the same numbers in a batch of 1 and of 300 (one or more threads)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 512, generator=g), torch.randn(512, generator=g)
    gu = torch.randn(300, 2 * 1408, generator=g)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            norm, act = layer_ops.rms_norm(x, w, 1e-5), layer_ops.silu_mul(gu)
            for i in (0, 151, 299):
                assert torch.equal(norm[i], layer_ops.rms_norm(x[i : i + 1], w, 1e-5)[0])
                assert torch.equal(act[i], layer_ops.silu_mul(gu[i : i + 1])[0])
    finally:
        torch.set_num_threads(before)
