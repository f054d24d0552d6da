"""splitserve's CPU kernels (splitserve/kernels/cpu_kernels.cpp) against torch: the packed GEMM (and the model on
it), and decode attention read in place from the paged KV cache."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import build, cpu_gemm, paged_decode
from splitserve.model import AttentionMetadata, load_model

pytestmark = pytest.mark.skipif(not build.enabled(), reason="no AVX2 on this CPU (or PD_CPU_KERNELS=0)")


def test_the_kernel_builds_on_a_machine_with_avx2():
    assert build.load() is not None, "g++/ninja missing? the model would run on torch.mm"


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_row_does_not_depend_on_the_rows_beside_it_or_the_thread_count(dtype):
    """Bitwise: a sequence's logits in a decode batch of 1 and of 13 are the same numbers (1 or 2 threads); for
    16-bit weights one row is widened in registers and 13 rows once per panel piece."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1024, 512, generator=g), torch.randn(13, 512, generator=g)
    packed = cpu_gemm.pack(w.to(dtype))
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


def _prefill_then_decode(m) -> list[torch.Tensor]:
    """Logits of an 8-token prefill and of two decode steps after it (one block of 16)."""
    ids = torch.tensor([5, 9, 200, 31, 7, 64, 3, 11])
    cache = m.model.allocate_kv_cache(1, 16)
    out = [m.model(ids, torch.arange(8), cache, AttentionMetadata(torch.arange(8), [8], [8], [[0]], 16))]
    for pos, tok in ((8, 42), (9, 17)):
        meta = AttentionMetadata(torch.tensor([pos]), [1], [pos + 1], [[0]], 16)
        out.append(m.model(torch.tensor([tok]), torch.tensor([pos]), cache, meta))
    return out


def test_float32_cpu_models_run_on_packed_weights_and_match_torch_mm(monkeypatch):
    """Packed GEMM, the layer kernels (norms, SiLU * up, RoPE + K/V store) and the decode kernel against torch."""
    lm = load_model("synthetic:llama-tiny")
    attn = lm.model.model.layers[0].self_attn
    assert attn.qkv_proj.packed is not None and attn.qkv_proj.weight_t is None
    assert lm.model.model.layers[0].cpu_layer_ops
    on_kernels = _prefill_then_decode(lm)
    monkeypatch.setenv("PD_CPU_KERNELS", "0")
    plain = load_model("synthetic:llama-tiny")
    assert plain.model.model.layers[0].self_attn.qkv_proj.packed is None
    assert not plain.model.model.layers[0].cpu_layer_ops
    torch.testing.assert_close(attn.qkv_proj.weight, plain.model.model.layers[0].self_attn.qkv_proj.weight)
    for got, want in zip(on_kernels, _prefill_then_decode(plain)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models_pack_16_bit_weights_and_compute_in_float32(dtype):
    lm = load_model("synthetic:llama-tiny", dtype=str(dtype).removeprefix("torch."))
    layer = lm.model.model.layers[0]
    assert layer.mlp.gate_up_proj.packed.dtype == dtype and layer.mlp.gate_up_proj.weight_t is None
    assert lm.model.lm_head_packed.dtype == dtype  # tied: packed as a copy, the embedding stays 16-bit
    assert lm.model.model.embed_tokens.weight.dtype == dtype
    assert layer.input_layernorm.weight.dtype == torch.float32 and lm.model.activation_dtype == torch.float32
    assert lm.model.allocate_kv_cache(2, 16).dtype == dtype  # the KV cache (and what a KV block moves) stays 16-bit


def _paged(num_blocks, layers, bs, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, layers, 2, bs, hkv, d, generator=g), g


@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 64), (8, 2, 16), (4, 4, 12), (6, 1, 8)])
def test_paged_decode_attention_equals_sdpa_over_the_gathered_context(hq, hkv, d):
    """GQA groups of 1..6, head_dim not a multiple of 8, contexts at and across block boundaries, random block ids."""
    bs, layers, layer = 4, 3, 1
    cache, g = _paged(64, layers, bs, hkv, d, hq * 100 + d)
    lens = [1, bs - 1, bs, bs + 1, 3 * bs, 37]
    m = max(-(-n // bs) for n in lens)
    ids = torch.randperm(64, generator=g).tolist()
    tables = [ids[i * m : (i + 1) * m] for i in range(len(lens))]
    q = torch.randn(len(lens), hq, d, generator=g)
    got = paged_decode.paged_decode_attention(q, cache, layer, torch.tensor(tables), torch.tensor(lens))
    for b, n in enumerate(lens):
        k = cache[tables[b], layer, 0].reshape(-1, hkv, d)[:n].transpose(0, 1)  # [Hkv, n, D]
        v = cache[tables[b], layer, 1].reshape(-1, hkv, d)[:n].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True).squeeze(1)  # [Hq, D]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_refuses_bad_tables():
    cache, _ = _paged(8, 1, 4, 2, 8, 0)
    q = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode.paged_decode_attention(q, cache, 0, torch.tensor([[8, 0]]), torch.tensor([5]))
    with pytest.raises(RuntimeError, match="not in"):
        paged_decode.paged_decode_attention(q, cache, 0, torch.tensor([[1, 0]]), torch.tensor([9]))
    with pytest.raises(RuntimeError, match="layer"):
        paged_decode.paged_decode_attention(q, cache, 1, torch.tensor([[1, 0]]), torch.tensor([5]))


def test_float32_cpu_decode_steps_plan_the_kernel_and_others_do_not(monkeypatch):
    from splitserve.model.attention import plan_attention

    meta = AttentionMetadata(torch.tensor([1, 9]), [1, 1], [6, 2], [[1, 0], [2]], 4)
    assert plan_attention(meta, 2, torch.zeros(4, 1, 2, 4, 1, 8)).in_place_decode is not None
    bf16_cache = torch.zeros(4, 1, 2, 4, 1, 8, dtype=torch.bfloat16)
    assert plan_attention(meta, 2, bf16_cache).in_place_decode is None  # bf16 activations (torch's path)
    assert plan_attention(meta, 2, bf16_cache, torch.float32).in_place_decode is not None  # float32 over bf16 KV
    monkeypatch.setenv("PD_CPU_KERNELS", "0")
    assert plan_attention(meta, 2, torch.zeros(4, 1, 2, 4, 1, 8)).in_place_decode is None


def test_a_build_lock_left_by_a_killed_builder_is_cleared_not_waited_on(tmp_path):
    """torch's FileBaton ``lock`` stays behind when its builder dies; under splitserve's flock it can only be stale."""
    (tmp_path / "lock").touch()
    assert build.clear_stale_torch_lock(tmp_path)
    assert not (tmp_path / "lock").exists()
    assert not build.clear_stale_torch_lock(tmp_path)
