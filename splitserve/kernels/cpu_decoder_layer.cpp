// One decoder layer of a decode-only step in one call (splitserve/kernels/decoder_layer.py): the same kernels, in the
// same order, as the Python layer of splitserve/model/llama.py runs them one call each, so the result is identical
// bit for bit; only the ~20 Python-level calls per layer (and their argument checks) are gone. On a small model a
// decode step's Python overhead was ~25% of its time on this project's 2-core machine (cProfile, 2026-12-02).
//
//   h [T, hidden] float32 -> h + attn(norm(h)) -> that + mlp(norm(that)), T decodes (one new token each), with this
//   step's K/V stored in kv_cache [num_blocks, L, 2, block_size, Hkv, D] at (write_blocks[t], write_offsets[t]).
#include <torch/extension.h>

#include "cpu_kernels.h"

torch::Tensor decoder_layer(const torch::Tensor& h, const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                            double eps, const torch::Tensor& qkv_packed, const c10::optional<torch::Tensor>& qkv_bias,
                            const torch::Tensor& o_packed, const c10::optional<torch::Tensor>& o_bias,
                            const torch::Tensor& gate_up_packed, const torch::Tensor& down_packed, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, const torch::Tensor& cos,
                            const torch::Tensor& signed_sin, const torch::Tensor& kv_cache, int64_t layer,
                            const torch::Tensor& write_blocks, const torch::Tensor& write_offsets,
                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(h.dim() == 2, "decoder_layer: h must be [T, hidden]");
  const int64_t T = h.size(0), hidden = h.size(1), Hq = num_heads, Hkv = num_kv_heads, D = head_dim;
  auto qkv = packed_gemm(rms_norm(h, input_norm, eps), qkv_packed, (Hq + 2 * Hkv) * D, c10::nullopt, 0);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  qkv = qkv.view({T, Hq + 2 * Hkv, D});
  rope_write_kv(qkv, cos, signed_sin, kv_cache, layer, write_blocks, write_offsets, Hkv);
  const auto attn = paged_decode_attention(qkv.narrow(1, 0, Hq), kv_cache, layer, block_tables, seq_lens, scale, 0);
  auto h1 = packed_gemm(attn.view({T, Hq * D}), o_packed, hidden, h, 0);
  if (o_bias.has_value()) h1.add_(*o_bias);
  const auto act = silu_mul(packed_gemm(rms_norm(h1, post_norm, eps), gate_up_packed, 2 * intermediate, c10::nullopt, 0));
  return packed_gemm(act, down_packed, hidden, h1, 0);
}
