// Small-M fp32 GEMM over weights packed in 16-column panels, for decode steps on AVX2/FMA CPUs.
//
//   out[M, N] = residual[M, N] (or 0) + x[M, K] @ W^T,   W: [N, K] (a Linear's weight)
//
// The weight is packed once at load (splitserve/kernels/cpu_gemm.py: pack) as panels [ceil(N/16), K, 16]:
// panel p holds columns [16p, 16p + 16) of W^T row by row, zero-padded past N. One panel is read as one
// sequential stream (K * 64 bytes), so a decode step (M = running sequences, 1..64) reads each weight byte
// from memory once, at close to the machine's streaming rate, instead of the strided or packed-per-call reads of
// a general sgemm (measured: tests of this project's benchmarks/results/engine_cpu_gemm.txt). Register tile:
// up to 6 rows x 16 columns (12 accumulators + 2 weight vectors + 1 broadcast = 15 of the 16 ymm registers,
// the classic AVX2 6x16 micro-kernel shape of BLIS/OpenBLAS sgemm). Rows of a panel are computed 6 at a time
// while the panel stays in L1/L2. Panels are split across torch's intra-op threads (at::parallel_for).
// Each output element sums k = 0..K-1 in order, so a row's result does not depend on M or the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;

// Accumulators are named locals, not an array: with an array GCC 12 kept them on the stack (a store per FMA).
#define SSK_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

template <int MR>
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

template <int MR>
inline void panel_rows(const float* x, int64_t K, const float* panel, float* out, const float* res, int64_t N,
                       int64_t n0, int64_t width) {
#define SSK_DECL(m) __m256 c##m##0 = _mm256_setzero_ps(), c##m##1 = _mm256_setzero_ps(); \
  const float* x##m = x + (m < MR ? m : 0) * K;
  SSK_ROWS(SSK_DECL)
#undef SSK_DECL
  const float* w = panel;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#define SSK_FMA(m) if constexpr (m < MR) { const __m256 b = _mm256_broadcast_ss(x##m + k); \
    c##m##0 = _mm256_fmadd_ps(b, w0, c##m##0); c##m##1 = _mm256_fmadd_ps(b, w1, c##m##1); }
    SSK_ROWS(SSK_FMA)
#undef SSK_FMA
  }
#define SSK_STORE(m) if constexpr (m < MR) { \
    store_row<MR>(c##m##0, c##m##1, out + m * N + n0, res ? res + m * N + n0 : nullptr, width); }
  SSK_ROWS(SSK_STORE)
#undef SSK_STORE
}

void panel(const float* x, int64_t M, int64_t K, const float* packed, int64_t p, float* out, const float* res,
           int64_t N) {
  const float* pw = packed + p * K * kPanel;
  const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) panel_rows<6>(x + m * K, K, pw, out + m * N, res ? res + m * N : nullptr, N, n0, width);
  const float* xr = x + m * K;
  float* o = out + m * N;
  const float* r = res ? res + m * N : nullptr;
  switch (M - m) {
    case 5: panel_rows<5>(xr, K, pw, o, r, N, n0, width); break;
    case 4: panel_rows<4>(xr, K, pw, o, r, N, n0, width); break;
    case 3: panel_rows<3>(xr, K, pw, o, r, N, n0, width); break;
    case 2: panel_rows<2>(xr, K, pw, o, r, N, n0, width); break;
    case 1: panel_rows<1>(xr, K, pw, o, r, N, n0, width); break;
    default: break;
  }
}

}  // namespace

// x: [M, K] fp32 contiguous; packed: [ceil(N/16), K, 16] fp32 contiguous; residual: [M, N] fp32 contiguous or None.
torch::Tensor packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                          const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "packed_gemm: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kPanel - 1) / kPanel;
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
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) panel(xp, M, K, wp, p, op, res, N);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_gemm", &packed_gemm, "residual + x @ W^T over a 16-column panel-packed W (fp32, AVX2/FMA)");
}
