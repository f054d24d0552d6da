// The small per-layer operations of a float32 decoder layer on the CPU (AVX2/FMA), each one call where torch takes
// several (F.rms_norm alone is five ATen ops, ~90 us on [16, 512] on this project's 2-core machine):
//   rms_norm       RMSNorm of every row
//   silu_mul       SwiGLU's silu(gate) * up from the fused gate/up projection's output
//   rope_write_kv  rotary embedding of q and k in place, then this step's K/V rows stored in the paged KV cache
// Every row is computed alone, in the same order whatever the number of rows or threads, so a token's result does
// not depend on its batch (chunked == unchunked, disaggregated == colocated). Built with cpu_kernels.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu_simd.h"

namespace {

using splitserve_simd::exp256;
using splitserve_simd::hsum;

// below this many floats a call runs on one thread (an OpenMP fork costs more than the work)
constexpr int64_t kParallelFloats = 1 << 15;

int row_threads(int64_t rows, int64_t floats_per_row) {
  if (rows < 2 || rows * floats_per_row < kParallelFloats) return 1;
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), rows));
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(), what,
              " must be a contiguous 2-D float32 CPU tensor, got ", t.sizes(), " ", t.scalar_type());
}

}  // namespace

// x: [M, K], weight: [K] -> [M, K] = (x * rsqrt(mean(x^2) + eps)) * weight, the Hugging Face Llama order (the
// normalised row times the weight). The sum of squares runs over 8 lanes, then the lanes are added: rounding differs
// from torch's by a few ulp.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == K && weight.scalar_type() == torch::kFloat && weight.is_contiguous(),
              "rms_norm: weight must be [", K, "] float32 contiguous");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
#pragma omp parallel for num_threads(row_threads(M, K)) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float* o = op + m * K;
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_loadu_ps(xr + k);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; k < K; ++k) ss += xr[k] * xr[k];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + e);
    const __m256 rv = _mm256_set1_ps(r);
    for (k = 0; k + 8 <= K; k += 8)
      _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), rv), _mm256_loadu_ps(wp + k)));
    for (; k < K; ++k) o[k] = (xr[k] * r) * wp[k];
  }
  return out;
}

namespace {

// silu(g) * u for 8 lanes: sigmoid from e = exp(-|g|) (always <= 1, the range exp256 serves):
// g >= 0: 1 / (1 + e); g < 0: e / (1 + e)
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 neg_abs = _mm256_or_ps(g, _mm256_set1_ps(-0.0f));
  const __m256 e = exp256(neg_abs);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 num = _mm256_blendv_ps(one, e, g);  // the sign bit of g picks e
  const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

}  // namespace

// gate_up: [M, 2I] (gate columns, then up columns) -> [M, I] = silu(gate) * up
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up needs an even number of columns, got ", gate_up.size(1));
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for num_threads(row_threads(M, 2 * I)) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gp + m * 2 * I;
    const float* u = g + I;
    float* o = op + m * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < I) {  // the tail through the same lanes, so every column is computed alike
      alignas(32) float gt[8] = {0}, ut[8] = {0}, ot[8];
      std::memcpy(gt, g + i, (I - i) * sizeof(float));
      std::memcpy(ut, u + i, (I - i) * sizeof(float));
      _mm256_store_ps(ot, silu_mul8(_mm256_load_ps(gt), _mm256_load_ps(ut)));
      std::memcpy(o + i, ot, (I - i) * sizeof(float));
    }
  }
  return out;
}

// qkv: [T, Hq + 2 Hkv, D] contiguous (q heads, k heads, v heads of each new token); cos, signed_sin: [T, D] (sin with
// its first half negated, RotaryEmbedding.cos_sin). In place: the q and k heads become x * cos + roll(x, D/2) *
// signed_sin (Hugging Face rotate-half RoPE). Then each token's K and V rows are stored in the cache
// kv_cache [num_blocks, L, 2, block_size, Hkv, D] at (block_ids[t], layer, 0 / 1, offsets[t]). A bfloat16 or float16
// cache stores them rounded to nearest even (c10's conversion, torch's own), and the k and v heads of qkv are replaced
// by the rounded values: attention over this step's K/V (a prefill) then sees what later steps read from the cache.
namespace {

template <typename T>
void store_kv_row(float* x, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, x, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T r(x[i]);
      dst[i] = r;
      x[i] = static_cast<float>(r);
    }
  }
}

// Token t's K and V rows (the last 2 Hkv heads of its qkv row x) to its slot of `cache`.
template <typename T>
void store_kv(float* x, int64_t H, int64_t D, int64_t Hkv, T* cache, int64_t block, int64_t L, int64_t layer,
              int64_t bs, int64_t offset) {
  const int64_t row = Hkv * D;
  float* k = x + (H - 2 * Hkv) * D;
  T* dst = cache + ((block * L + layer) * 2 * bs + offset) * row;
  store_kv_row(k, dst, row);                   // K
  store_kv_row(k + row, dst + bs * row, row);  // V
}

}  // namespace

void rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                   const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& block_ids,
                   const torch::Tensor& offsets, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == torch::kFloat && qkv.is_contiguous() && qkv.device().is_cpu(),
              "rope_write_kv: qkv must be [T, Hq + 2 Hkv, D] float32 contiguous on the CPU");
  const int64_t T = qkv.size(0), H = qkv.size(1), D = qkv.size(2), Hkv = num_kv_heads, Hr = H - Hkv;
  TORCH_CHECK(D % 2 == 0, "rope_write_kv: head_dim must be even, got ", D);
  TORCH_CHECK(Hkv > 0 && H > 2 * Hkv, "rope_write_kv: ", H, " heads cannot hold q plus 2 x ", Hkv, " KV heads");
  for (const auto* t : {&cos, &signed_sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->scalar_type() == torch::kFloat &&
                t->is_contiguous(), "rope_write_kv: cos and signed_sin must be [T, D] float32 contiguous");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(2) == 2 && kv_cache.size(4) == Hkv && kv_cache.size(5) == D &&
              (kv_cache.scalar_type() == torch::kFloat || kv_cache.scalar_type() == torch::kBFloat16 ||
               kv_cache.scalar_type() == torch::kHalf) && kv_cache.is_contiguous() && kv_cache.device().is_cpu() &&
              0 <= layer && layer < kv_cache.size(1),
              "rope_write_kv: kv_cache must be [num_blocks, L, 2, block_size, ", Hkv, ", ", D,
              "] float32, bfloat16 or float16 contiguous with layer < L");
  for (const auto* t : {&block_ids, &offsets})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == T && t->scalar_type() == torch::kLong && t->is_contiguous(),
                "rope_write_kv: block_ids and offsets must be [T] int64 contiguous");
  const int64_t num_blocks = kv_cache.size(0), L = kv_cache.size(1), bs = kv_cache.size(3);
  const int64_t* blk = block_ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= blk[t] && blk[t] < num_blocks && 0 <= off[t] && off[t] < bs, "rope_write_kv: slot (block ",
                blk[t], ", offset ", off[t], ") of token ", t, " is outside the cache");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  const int64_t half = D / 2;
  const auto ct = kv_cache.scalar_type();  // the cache's pointer, typed once (not per token)
  float* cache_f32 = ct == torch::kFloat ? kv_cache.data_ptr<float>() : nullptr;
  c10::BFloat16* cache_bf16 = ct == torch::kBFloat16 ? kv_cache.data_ptr<c10::BFloat16>() : nullptr;
  c10::Half* cache_f16 = ct == torch::kHalf ? kv_cache.data_ptr<c10::Half>() : nullptr;
#pragma omp parallel for num_threads(row_threads(T, H * D)) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cp + t * D;
    const float* s = sp + t * D;
    float* x = xp + t * H * D;
    for (int64_t h = 0; h < Hr; ++h, x += D) {  // q heads, then k heads
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        const __m256 ra = _mm256_fmadd_ps(b, _mm256_loadu_ps(s + i), _mm256_mul_ps(a, _mm256_loadu_ps(c + i)));
        const __m256 rb = _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + i), _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)));
        _mm256_storeu_ps(x + i, ra);
        _mm256_storeu_ps(x + half + i, rb);
      }
      for (; i < half; ++i) {  // head_dim not a multiple of 16: the same arithmetic, one lane at a time
        const float a = x[i], b = x[half + i];
        x[i] = std::fma(b, s[i], a * c[i]);
        x[half + i] = std::fma(a, s[half + i], b * c[half + i]);
      }
    }
    float* row = xp + t * H * D;
    if (cache_f32) store_kv(row, H, D, Hkv, cache_f32, blk[t], L, layer, bs, off[t]);
    else if (cache_bf16) store_kv(row, H, D, Hkv, cache_bf16, blk[t], L, layer, bs, off[t]);
    else store_kv(row, H, D, Hkv, cache_f16, blk[t], L, layer, bs, off[t]);
  }
}
