"""splitserve's packed CPU GEMM kernel (splitserve/kernels/cpu_gemm.cpp) against torch, and the model on it."""

import pytest
import torch

from splitserve.kernels import cpu_gemm
from splitserve.model import load_model

pytestmark = pytest.mark.skipif(not cpu_gemm.enabled(), reason="no AVX2 on this CPU (or PD_CPU_KERNELS=0)")


def test_the_kernel_builds_on_a_machine_with_avx2():
    assert cpu_gemm.load() is not None, "g++/ninja missing? the model would run on torch.mm"


@pytest.mark.parametrize("n", [16, 50, 2048])
@pytest.mark.parametrize("k", [1, 37, 512])
def test_packed_gemm_equals_torch_for_every_row_count(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    packed = cpu_gemm.pack(w)
    assert packed.shape == (-(-n // 16), k, 16)
    assert torch.equal(cpu_gemm.unpack(packed, n), w)
    for m in (1, 2, 3, 5, 6, 7, 12, 13, 64):
        x, residual = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
        torch.testing.assert_close(cpu_gemm.packed_gemm(x, packed, n), x @ w.t(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cpu_gemm.packed_gemm(x, packed, n, residual), residual + x @ w.t(), rtol=1e-4, atol=1e-4)


def test_a_row_does_not_depend_on_the_rows_beside_it_or_the_thread_count():
    """Bitwise: a sequence's logits in a decode batch of 1 and of 13 are the same numbers (1 or 2 threads)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1024, 512, generator=g), torch.randn(13, 512, generator=g)
    packed = cpu_gemm.pack(w)
    alone = torch.cat([cpu_gemm.packed_gemm(x[i : i + 1], packed, 1024) for i in range(13)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_gemm.packed_gemm(x, packed, 1024), alone)
    finally:
        torch.set_num_threads(before)


def test_bad_operands_raise_not_crash():
    packed = cpu_gemm.pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="packed must be"):
        cpu_gemm.packed_gemm(torch.randn(2, 9), packed, 32)  # K mismatch
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_gemm.packed_gemm(torch.randn(2, 8, dtype=torch.float64), packed, 32)
    with pytest.raises(RuntimeError, match="residual must be"):
        cpu_gemm.packed_gemm(torch.randn(2, 8), packed, 32, torch.randn(3, 32))


def test_float32_cpu_models_run_on_packed_weights_and_match_torch_mm(monkeypatch):
    lm = load_model("synthetic:llama-tiny")
    attn = lm.model.model.layers[0].self_attn
    assert attn.qkv_proj.packed is not None and attn.qkv_proj.weight_t is None
    monkeypatch.setenv("PD_CPU_KERNELS", "0")
    plain = load_model("synthetic:llama-tiny")
    assert plain.model.model.layers[0].self_attn.qkv_proj.packed is None
    torch.testing.assert_close(attn.qkv_proj.weight, plain.model.model.layers[0].self_attn.qkv_proj.weight)
    from splitserve.model.attention import AttentionMetadata

    ids = torch.tensor([5, 9, 200, 31, 7, 64, 3, 11])
    logits = []
    for m in (lm, plain):
        cache = m.model.allocate_kv_cache(1, 16)
        meta = AttentionMetadata(torch.arange(len(ids)), [len(ids)], [len(ids)], [[0]], 16)
        logits.append(m.model(ids, torch.arange(len(ids)), cache, meta))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_bfloat16_models_keep_torch_weights():
    lm = load_model("synthetic:llama-tiny", dtype="bfloat16")
    assert lm.model.model.layers[0].mlp.gate_up_proj.packed is None
