// The kernels of splitserve's CPU extension as C++ functions (each also bound to Python in cpu_kernels.cpp), for
// kernels that call kernels (cpu_decoder_layer.cpp).
#pragma once
#include <torch/extension.h>

// cpu_kernels.cpp
torch::Tensor packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                          const c10::optional<torch::Tensor>& residual, int64_t threads);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, int64_t layer,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                     int64_t threads);
// cpu_layer_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                   const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& block_ids,
                   const torch::Tensor& offsets, int64_t num_kv_heads);
// cpu_decoder_layer.cpp
torch::Tensor decoder_layer(const torch::Tensor& h, const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                            double eps, const torch::Tensor& qkv_packed, const c10::optional<torch::Tensor>& qkv_bias,
                            const torch::Tensor& o_packed, const c10::optional<torch::Tensor>& o_bias,
                            const torch::Tensor& gate_up_packed, const torch::Tensor& down_packed, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, const torch::Tensor& cos,
                            const torch::Tensor& signed_sin, const torch::Tensor& kv_cache, int64_t layer,
                            const torch::Tensor& write_blocks, const torch::Tensor& write_offsets,
                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale);
