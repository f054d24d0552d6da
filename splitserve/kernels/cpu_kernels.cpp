// splitserve's CPU kernels (float32, AVX2/FMA), built by splitserve/kernels/build.py:
//   packed_gemm             projections of every step (below)
//   paged_decode_attention  decode attention read in place from the paged KV cache (further below)
//
// packed_gemm: small-M fp32 GEMM over weights packed in 16-column panels.
//
//   out[M, N] = residual[M, N] (or 0) + x[M, K] @ W^T,   W: [N, K] (a Linear's weight)
//
// The weight is packed once at load (splitserve/kernels/cpu_gemm.py: pack) as panels [ceil(N/16), K, 16]:
// panel p holds columns [16p, 16p + 16) of W^T row by row, zero-padded past N. One panel is read as one
// sequential stream (K * 64 bytes), so a decode step (M = running sequences, 1..64) reads each weight byte
// from memory once, at close to the machine's streaming rate, instead of the strided or packed-per-call reads of
// a general sgemm (benchmarks/cpu_gemm.py, benchmarks/results/engine_cpu_kernels.txt). Register tile:
// up to 6 rows x 16 columns (12 accumulators + 2 weight vectors + 1 broadcast = 15 of the 16 ymm registers,
// the classic AVX2 6x16 micro-kernel shape of BLIS/OpenBLAS sgemm). Rows of x are computed 6 at a time; with more
// than 6, every tile works on a 128-k piece of the panel while it is in L1 (see panel()). Panels are split across
// `threads` OpenMP threads (0: torch's intra-op count).
// Each output element sums k = 0..K-1 in order, so a row's result does not depend on M or the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;

// Accumulators are named locals, not an array: with an array GCC 12 kept them on the stack (a store per FMA).
#define SSK_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

inline void store_row(__m256 lo, __m256 hi, float* o, const float* r, int64_t width) {
  if (width == kPanel) {
    if (r) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(r));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(r + 8));
    }
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
  } else {  // the last panel of an N that is not a multiple of 16
    alignas(32) float tmp[kPanel];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    for (int64_t j = 0; j < width; ++j) o[j] = tmp[j] + (r ? r[j] : 0.0f);
  }
}

// Rows [0, MR) of x times panel rows [k0, k1) of one panel, accumulating into acc ([MR][16] floats): from zero when
// k0 == 0, else from acc. A float stored and loaded back is unchanged, so splitting k into ranges keeps each output's
// sum in the order k = 0..K-1: the result does not depend on the split.
template <int MR>
inline void panel_rows(const float* x, int64_t K, int64_t k0, int64_t k1, const float* panel, float* acc) {
#define SSK_DECL(m) __m256 c##m##0 = _mm256_setzero_ps(), c##m##1 = _mm256_setzero_ps(); \
  const float* x##m = x + (m < MR ? m : 0) * K; \
  if (m < MR && k0 > 0) { c##m##0 = _mm256_load_ps(acc + m * kPanel); c##m##1 = _mm256_load_ps(acc + m * kPanel + 8); }
  SSK_ROWS(SSK_DECL)
#undef SSK_DECL
  const float* w = panel + k0 * kPanel;
  for (int64_t k = k0; k < k1; ++k, w += kPanel) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#define SSK_FMA(m) if constexpr (m < MR) { const __m256 b = _mm256_broadcast_ss(x##m + k); \
    c##m##0 = _mm256_fmadd_ps(b, w0, c##m##0); c##m##1 = _mm256_fmadd_ps(b, w1, c##m##1); }
    SSK_ROWS(SSK_FMA)
#undef SSK_FMA
  }
#define SSK_STORE(m) if constexpr (m < MR) { \
    _mm256_store_ps(acc + m * kPanel, c##m##0); _mm256_store_ps(acc + m * kPanel + 8, c##m##1); }
  SSK_ROWS(SSK_STORE)
#undef SSK_STORE
}

inline void rows_of_panel(int64_t rows, const float* x, int64_t K, int64_t k0, int64_t k1, const float* pw, float* acc) {
  switch (rows) {
    case 6: panel_rows<6>(x, K, k0, k1, pw, acc); break;
    case 5: panel_rows<5>(x, K, k0, k1, pw, acc); break;
    case 4: panel_rows<4>(x, K, k0, k1, pw, acc); break;
    case 3: panel_rows<3>(x, K, k0, k1, pw, acc); break;
    case 2: panel_rows<2>(x, K, k0, k1, pw, acc); break;
    case 1: panel_rows<1>(x, K, k0, k1, pw, acc); break;
    default: break;
  }
}

// Up to kRowsPerPass rows share one read of the panel from memory. With more than 6 rows (several register tiles)
// the panel is walked in kChunk-row pieces (8 KB, L1-resident) and every tile takes its turn on a piece before the
// next piece is read: the weight stream from memory overlaps the tiles' FMAs instead of being re-read from L2 once per
// tile (measured before this: each extra tile cost a full pass, M = 16 took 2x M = 6).
constexpr int64_t kRowsPerPass = 60;
constexpr int64_t kChunk = 128;

void panel(const float* x, int64_t M, int64_t K, const float* packed, int64_t p, float* out, const float* res,
           int64_t N) {
  const float* pw = packed + p * K * kPanel;
  const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
  alignas(32) float acc[kRowsPerPass * kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int64_t rows = std::min(kRowsPerPass, M - m0), chunk = rows <= 6 ? K : kChunk;
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      const int64_t k1 = std::min(K, k0 + chunk);
      for (int64_t m = 0; m < rows; m += 6)
        rows_of_panel(std::min<int64_t>(6, rows - m), x + (m0 + m) * K, K, k0, k1, pw, acc + m * kPanel);
    }
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t row = m0 + m;
      store_row(_mm256_load_ps(acc + m * kPanel), _mm256_load_ps(acc + m * kPanel + 8), out + row * N + n0,
                res ? res + row * N + n0 : nullptr, width);
    }
  }
}

}  // namespace

// x: [M, K] fp32 contiguous; packed: [ceil(N/16), K, 16] fp32 contiguous; residual: [M, N] fp32 contiguous or None.
// Threads of a kernel call: `threads` > 0 as given, else torch's intra-op count. The kernels take their own count so
// that a decode step can run them on every core while torch's small ops (norms, RoPE, SiLU) stay on one thread.
static int kernel_threads(int64_t threads) {
  return static_cast<int>(threads > 0 ? threads : at::get_num_threads());
}

torch::Tensor packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                          const c10::optional<torch::Tensor>& residual, int64_t threads) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "packed_gemm: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K >= 1, "packed_gemm: x needs at least one column");
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == panels && packed.size(1) == K && packed.size(2) == kPanel &&
              packed.scalar_type() == torch::kFloat && packed.is_contiguous(),
              "packed_gemm: packed must be [ceil(N/16), K, 16] float32 contiguous, got ", packed.sizes(), " for N=", N,
              " K=", K);
  const float* res = nullptr;
  if (residual.has_value()) {
    const auto& r = *residual;
    TORCH_CHECK(r.dim() == 2 && r.size(0) == M && r.size(1) == N && r.scalar_type() == torch::kFloat && r.is_contiguous(),
                "packed_gemm: residual must be [M, N] float32 contiguous");
    res = r.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int nt = std::min<int64_t>(kernel_threads(threads), std::max<int64_t>(1, panels / 4));
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t p = 0; p < panels; ++p) panel(xp, M, K, wp, p, op, res, N);
  return out;
}

// paged_decode_attention: one query token per sequence (a decode step) against its whole context, read in place
// from the paged KV cache: no gathered copy of the context, no padding to the longest sequence of the batch, and
// grouped-query attention without repeating K/V (the G = Hq / Hkv query heads of a KV head share each K/V row).
//
//   q            [B, Hq, D]                               float32, rows [Hq, D] contiguous (RoPE applied)
//   kv_cache     [num_blocks, L, 2, block_size, Hkv, D]   float32 contiguous (this layer's K and V already written)
//   block_tables [B, M] int64 (rows padded past each context), seq_lens [B] int64 (context tokens, >= 1)
//   returns      [B, Hq, D] = softmax(q k^T * scale) v over positions [0, seq_len) of each sequence
//
// Per sequence (split across `threads` OpenMP threads, 0: torch's count): walk its blocks once for K (a token's K
// rows of all heads are one contiguous run, a block bs of them in a row: sequential reads) to get every query
// head's scores, exact softmax (max-subtracted, exp below), then once for V for the weighted sums. Query head j
// attends with KV head j / G (Hugging Face repeat_kv). Each sequence is computed alone, so its output does not
// depend on the rest of the batch.
namespace {

using splitserve_simd::exp256;
using splitserve_simd::hsum;

inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t d) {  // y += a * x
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < d; ++i) y[i] += a * x[i];
}

// softmax of s[0, n) in place; returns nothing (the row sums to 1)
inline void softmax(float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mb));
    _mm256_storeu_ps(s + i, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  if (i < n) {  // the tail through the same exp, so every position is computed alike
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? s[i + j] - m : -INFINITY;
    _mm256_store_ps(tail, exp256(_mm256_load_ps(tail)));
    for (int64_t j = 0; i + j < n; ++j) {
      s[i + j] = tail[j];
      sum += tail[j];
    }
  }
  const float inv = 1.0f / sum;
  for (i = 0; i < n; ++i) s[i] *= inv;
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, int64_t layer,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                     int64_t threads) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
              q.device().is_cpu(), "paged_decode_attention: q must be [B, Hq, D] float32 on the CPU, each row's heads "
              "contiguous (a row stride of its own, e.g. the q heads of a fused qkv output)");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(2) == 2 && kv_cache.scalar_type() == torch::kFloat &&
              kv_cache.is_contiguous() && kv_cache.device().is_cpu(),
              "paged_decode_attention: kv_cache must be [num_blocks, L, 2, block_size, Hkv, D] float32 contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(0), L = kv_cache.size(1), bs = kv_cache.size(3), Hkv = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == D && Hkv > 0 && Hq % Hkv == 0 && 0 <= layer && layer < L,
              "paged_decode_attention: head_dim, head counts or layer do not match the cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == torch::kLong &&
              block_tables.is_contiguous() && seq_lens.dim() == 1 && seq_lens.size(0) == B &&
              seq_lens.scalar_type() == torch::kLong && seq_lens.is_contiguous(),
              "paged_decode_attention: block_tables must be [B, M] int64 and seq_lens [B] int64, contiguous");
  const int64_t M = block_tables.size(1), G = Hq / Hkv;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= M * bs, "paged_decode_attention: seq_len ", lens[b], " of sequence ", b,
                " is not in [1, ", M * bs, "]");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tables[b * M + j] >= 0 && tables[b * M + j] < num_blocks, "paged_decode_attention: block id ",
                  tables[b * M + j], " out of range");
  }
  auto out = torch::zeros({B, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0);
  const float* cache = kv_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = Hkv * D;               // one token of one of K / V
  const int64_t kv_stride = bs * row;        // K -> V within a block and layer
  const int64_t block_stride = L * 2 * kv_stride;
  const float sc = static_cast<float>(scale);
  const int nt = std::min<int64_t>(kernel_threads(threads), B);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = lens[b];
      scores.resize(Hq * n);
      const float* qb = qp + b * q_row;
      float* ob = op + b * Hq * D;
      // K pass: token t's K row of every head is one contiguous Hkv * D run; a block holds bs of them in a row
      for (int64_t j = 0, t = 0; t < n; ++j) {
        const float* k = cache + tables[b * M + j] * block_stride + layer * 2 * kv_stride;
        for (const int64_t end = std::min(n, t + bs); t < end; ++t, k += row)
          for (int64_t hq = 0; hq < Hq; ++hq) scores[hq * n + t] = dot(qb + hq * D, k + (hq / G) * D, D) * sc;
      }
      for (int64_t hq = 0; hq < Hq; ++hq) softmax(scores.data() + hq * n, n);
      for (int64_t j = 0, t = 0; t < n; ++j) {  // V pass, same walk
        const float* v = cache + tables[b * M + j] * block_stride + layer * 2 * kv_stride + kv_stride;
        for (const int64_t end = std::min(n, t + bs); t < end; ++t, v += row)
          for (int64_t hq = 0; hq < Hq; ++hq) axpy(scores[hq * n + t], v + (hq / G) * D, ob + hq * D, D);
      }
    }
  }
  return out;
}

// cpu_layer_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
void rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                   const torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& block_ids,
                   const torch::Tensor& offsets, int64_t num_kv_heads);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_gemm", &packed_gemm, "residual + x @ W^T over a 16-column panel-packed W (fp32, AVX2/FMA)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention read in place from the paged KV cache");
  m.def("rms_norm", &rms_norm, "RMSNorm of every row (fp32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up output (fp32)");
  m.def("rope_write_kv", &rope_write_kv, "RoPE of q and k in place, then K/V rows stored in the paged KV cache");
}
