// splitserve's CPU kernels (float32 arithmetic, AVX2/FMA/F16C), built by splitserve/kernels/build.py:
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
//
// 16-bit weights (bfloat16, float16): the panels are stored in that type (half the bytes a decode step reads) and
// widened to float32 as they are loaded (exact), so x, the accumulation and the output stay float32: weight-only
// reduced precision, the scheme llama.cpp uses for 16-bit weights on CPUs without bf16/fp16 arithmetic. A decode tile
// (<= 6 rows) widens in registers; with more rows each 128-k piece is widened once into an L1 buffer that every tile
// then reads as float32. Both give the same sums (the widening is exact), so prefill and decode agree.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
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

using splitserve_simd::load8;

// Rows [0, MR) of x times panel rows [k0, k1) of one panel (w: the panel's row k0), accumulating into acc ([MR][16]
// floats): from zero when k0 == 0, else from acc. A float stored and loaded back is unchanged, so splitting k into
// ranges keeps each output's sum in the order k = 0..K-1: the result does not depend on the split.
template <int MR, typename W>
inline void panel_rows(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w, float* acc) {
#define SSK_DECL(m) __m256 c##m##0 = _mm256_setzero_ps(), c##m##1 = _mm256_setzero_ps(); \
  const float* x##m = x + (m < MR ? m : 0) * K; \
  if (m < MR && k0 > 0) { c##m##0 = _mm256_load_ps(acc + m * kPanel); c##m##1 = _mm256_load_ps(acc + m * kPanel + 8); }
  SSK_ROWS(SSK_DECL)
#undef SSK_DECL
  for (int64_t k = k0; k < k1; ++k, w += kPanel) {
    const __m256 w0 = load8(w), w1 = load8(w + 8);
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

template <typename W>
inline void rows_of_panel(int64_t rows, const float* x, int64_t K, int64_t k0, int64_t k1, const W* w, float* acc) {
  switch (rows) {
    case 6: panel_rows<6>(x, K, k0, k1, w, acc); break;
    case 5: panel_rows<5>(x, K, k0, k1, w, acc); break;
    case 4: panel_rows<4>(x, K, k0, k1, w, acc); break;
    case 3: panel_rows<3>(x, K, k0, k1, w, acc); break;
    case 2: panel_rows<2>(x, K, k0, k1, w, acc); break;
    case 1: panel_rows<1>(x, K, k0, k1, w, acc); break;
    default: break;
  }
}

// Up to kRowsPerPass rows share one read of the panel from memory. With more than 6 rows (several register tiles)
// the panel is walked in kChunk-row pieces (8 KB as float32, L1-resident) and every tile takes its turn on a piece
// before the next piece is read: the weight stream from memory overlaps the tiles' FMAs instead of being re-read from
// L2 once per tile (measured before this: each extra tile cost a full pass, M = 16 took 2x M = 6). A 16-bit piece is
// widened to float32 once, into `wide`, for all the tiles.
constexpr int64_t kRowsPerPass = 60;
constexpr int64_t kChunk = 128;

template <typename W>
void panel(const float* x, int64_t M, int64_t K, const W* packed, int64_t p, float* out, const float* res,
           int64_t N) {
  const W* pw = packed + p * K * kPanel;
  const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
  alignas(32) float acc[kRowsPerPass * kPanel];
  alignas(32) float wide[std::is_same_v<W, float> ? 1 : kChunk * kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int64_t rows = std::min(kRowsPerPass, M - m0), chunk = rows <= 6 ? K : kChunk;
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      const int64_t k1 = std::min(K, k0 + chunk);
      const W* w = pw + k0 * kPanel;
      if constexpr (!std::is_same_v<W, float>) {
        if (rows > 6) {
          for (int64_t i = 0; i < (k1 - k0) * kPanel; i += 8) _mm256_store_ps(wide + i, load8(w + i));
          for (int64_t m = 0; m < rows; m += 6)
            rows_of_panel(std::min<int64_t>(6, rows - m), x + (m0 + m) * K, K, k0, k1, wide, acc + m * kPanel);
          continue;
        }
      }
      for (int64_t m = 0; m < rows; m += 6)
        rows_of_panel(std::min<int64_t>(6, rows - m), x + (m0 + m) * K, K, k0, k1, w, acc + m * kPanel);
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

// One or two rows (a decode step of one or two sequences) times two adjacent panels p, p + 1 (32 columns): with
// one row a panel alone keeps only 2 FMA chains in flight (each FMA waits ~4 cycles for the previous one on the same
// accumulator), below the rate the weights stream in at; two panels double the chains. Each output still sums
// k = 0..K-1 in order: the same numbers as panel().
template <int MR, typename W>
void panel_pair(const float* x, int64_t K, const W* packed, int64_t p, float* out, const float* res, int64_t N) {
  const W* w = packed + p * K * kPanel;
  const W* v = w + K * kPanel;
  __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a02 = _mm256_setzero_ps(), a03 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps(), a12 = _mm256_setzero_ps(), a13 = _mm256_setzero_ps();
  const float* x1 = x + (MR > 1 ? K : 0);
  for (int64_t k = 0; k < K; ++k, w += kPanel, v += kPanel) {
    const __m256 w0 = load8(w), w1 = load8(w + 8), v0 = load8(v), v1 = load8(v + 8);
    const __m256 b0 = _mm256_broadcast_ss(x + k);
    a00 = _mm256_fmadd_ps(b0, w0, a00);
    a01 = _mm256_fmadd_ps(b0, w1, a01);
    a02 = _mm256_fmadd_ps(b0, v0, a02);
    a03 = _mm256_fmadd_ps(b0, v1, a03);
    if constexpr (MR > 1) {
      const __m256 b1 = _mm256_broadcast_ss(x1 + k);
      a10 = _mm256_fmadd_ps(b1, w0, a10);
      a11 = _mm256_fmadd_ps(b1, w1, a11);
      a12 = _mm256_fmadd_ps(b1, v0, a12);
      a13 = _mm256_fmadd_ps(b1, v1, a13);
    }
  }
  const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0 - kPanel);
  store_row(a00, a01, out + n0, res ? res + n0 : nullptr, kPanel);
  store_row(a02, a03, out + n0 + kPanel, res ? res + n0 + kPanel : nullptr, width);
  if constexpr (MR > 1) {
    store_row(a10, a11, out + N + n0, res ? res + N + n0 : nullptr, kPanel);
    store_row(a12, a13, out + N + n0 + kPanel, res ? res + N + n0 + kPanel : nullptr, width);
  }
}

template <typename W>
void packed_gemm_as(const float* x, int64_t M, int64_t K, const torch::Tensor& packed, int64_t N, float* out,
                    const float* res, int nt) {
  const W* wp = packed.data_ptr<W>();
  const int64_t panels = packed.size(0);
  if (M <= 2) {  // pairs of panels (the last one alone when their count is odd)
    const int64_t pairs = panels / 2;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i <= pairs; ++i) {
      if (i == pairs) {
        if (panels % 2) panel(x, M, K, wp, panels - 1, out, res, N);
      } else if (M == 1) {
        panel_pair<1>(x, K, wp, 2 * i, out, res, N);
      } else {
        panel_pair<2>(x, K, wp, 2 * i, out, res, N);
      }
    }
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t p = 0; p < panels; ++p) panel(x, M, K, wp, p, out, res, N);
}

torch::Tensor packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                          const c10::optional<torch::Tensor>& residual, int64_t threads) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "packed_gemm: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K >= 1, "packed_gemm: x needs at least one column");
  const auto wt = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == panels && packed.size(1) == K && packed.size(2) == kPanel &&
              (wt == torch::kFloat || wt == torch::kBFloat16 || wt == torch::kHalf) && packed.is_contiguous() &&
              packed.device().is_cpu(),
              "packed_gemm: packed must be [ceil(N/16), K, 16] float32, bfloat16 or float16 contiguous, got ",
              packed.sizes(), " ", wt, " for N=", N, " K=", K);
  const float* res = nullptr;
  if (residual.has_value()) {
    const auto& r = *residual;
    TORCH_CHECK(r.dim() == 2 && r.size(0) == M && r.size(1) == N && r.scalar_type() == torch::kFloat && r.is_contiguous(),
                "packed_gemm: residual must be [M, N] float32 contiguous");
    res = r.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  const int nt = std::min<int64_t>(kernel_threads(threads), std::max<int64_t>(1, panels / 4));
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (wt == torch::kFloat) packed_gemm_as<float>(xp, M, K, packed, N, op, res, nt);
  else if (wt == torch::kBFloat16) packed_gemm_as<c10::BFloat16>(xp, M, K, packed, N, op, res, nt);
  else packed_gemm_as<c10::Half>(xp, M, K, packed, N, op, res, nt);
  return out;
}

// paged_decode_attention: one query token per sequence (a decode step) against its whole context, read in place
// from the paged KV cache: no gathered copy of the context, no padding to the longest sequence of the batch, and
// grouped-query attention without repeating K/V (the G = Hq / Hkv query heads of a KV head share each K/V row).
//
//   q            [B, Hq, D]                               float32, rows [Hq, D] contiguous (RoPE applied)
//   kv_cache     [num_blocks, L, 2, block_size, Hkv, D]   float32, bfloat16 or float16 contiguous (this layer's K and
//                                                         V already written; 16-bit rows widened as they are read)
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
using splitserve_simd::load8;

template <typename T>  // b: a K row of the cache (float32, bfloat16 or float16), widened as it is read
inline float dot(const float* a, const T* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

template <typename T>  // y += a * x; x: a V row of the cache
inline void axpy(float a, const T* x, float* y, int64_t d) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < d; ++i) y[i] += a * static_cast<float>(x[i]);
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

// The kernel's loop over sequences, for a cache stored as T; arguments checked by paged_decode_attention.
template <typename T>
void attend(const torch::Tensor& q, const torch::Tensor& kv_cache, int64_t layer, const int64_t* tables, int64_t M,
            const int64_t* lens, float sc, int nt, torch::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t L = kv_cache.size(1), bs = kv_cache.size(3), Hkv = kv_cache.size(4), G = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0);
  const T* cache = kv_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t row = Hkv * D;               // one token of one of K / V
  const int64_t kv_stride = bs * row;        // K -> V within a block and layer
  const int64_t block_stride = L * 2 * kv_stride;
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
        const T* k = cache + tables[b * M + j] * block_stride + layer * 2 * kv_stride;
        for (const int64_t end = std::min(n, t + bs); t < end; ++t, k += row)
          for (int64_t hq = 0; hq < Hq; ++hq) scores[hq * n + t] = dot(qb + hq * D, k + (hq / G) * D, D) * sc;
      }
      for (int64_t hq = 0; hq < Hq; ++hq) softmax(scores.data() + hq * n, n);
      for (int64_t j = 0, t = 0; t < n; ++j) {  // V pass, same walk
        const T* v = cache + tables[b * M + j] * block_stride + layer * 2 * kv_stride + kv_stride;
        for (const int64_t end = std::min(n, t + bs); t < end; ++t, v += row)
          for (int64_t hq = 0; hq < Hq; ++hq) axpy(scores[hq * n + t], v + (hq / G) * D, ob + hq * D, D);
      }
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, int64_t layer,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                     int64_t threads) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
              q.device().is_cpu(), "paged_decode_attention: q must be [B, Hq, D] float32 on the CPU, each row's heads "
              "contiguous (a row stride of its own, e.g. the q heads of a fused qkv output)");
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(2) == 2 && kv_cache.is_contiguous() && kv_cache.device().is_cpu() &&
              (cache_type == torch::kFloat || cache_type == torch::kBFloat16 || cache_type == torch::kHalf),
              "paged_decode_attention: kv_cache must be [num_blocks, L, 2, block_size, Hkv, D] float32, bfloat16 or "
              "float16 contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(0), L = kv_cache.size(1), bs = kv_cache.size(3), Hkv = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == D && Hkv > 0 && Hq % Hkv == 0 && 0 <= layer && layer < L,
              "paged_decode_attention: head_dim, head counts or layer do not match the cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == torch::kLong &&
              block_tables.is_contiguous() && seq_lens.dim() == 1 && seq_lens.size(0) == B &&
              seq_lens.scalar_type() == torch::kLong && seq_lens.is_contiguous(),
              "paged_decode_attention: block_tables must be [B, M] int64 and seq_lens [B] int64, contiguous");
  const int64_t M = block_tables.size(1);
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
  const int nt = std::min<int64_t>(kernel_threads(threads), B);
  const float sc = static_cast<float>(scale);
  if (cache_type == torch::kFloat) attend<float>(q, kv_cache, layer, tables, M, lens, sc, nt, out);
  else if (cache_type == torch::kBFloat16) attend<c10::BFloat16>(q, kv_cache, layer, tables, M, lens, sc, nt, out);
  else attend<c10::Half>(q, kv_cache, layer, tables, M, lens, sc, nt, out);
  return out;
}

// Every kernel lets go of the GIL while it runs (they touch no Python object): a server's HTTP/gRPC threads keep
// streaming tokens while the engine thread is inside a kernel. Holding it, a one-call decoder layer (~1 ms) starved
// them: a colocated server's SSE tokens left in bursts (ITL p50 0.1 ms, TTFT up; peers run of 2026-12-02 15:37).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("packed_gemm", &packed_gemm, "residual + x @ W^T over a 16-column panel-packed W (fp32, AVX2/FMA)", release());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention read in place from the paged KV cache",
        release());
  m.def("rms_norm", &rms_norm, "RMSNorm of every row (fp32)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up output (fp32)", release());
  m.def("rope_write_kv", &rope_write_kv, "RoPE of q and k in place, then K/V rows stored in the paged KV cache",
        release());
  m.def("decoder_layer", &decoder_layer, "one decoder layer of a decode-only step (the kernels above, in one call)",
        release());
}
