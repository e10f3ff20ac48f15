// y = x W^T (+ bias) for the few rows of a decode step: x [M, K], W [N, K], bias [N], float32, M small.
//
// With few rows a GEMM is bound by reading W from memory, once a step; MKL's small-M path reads it well at
// M = 1 but is far from that bound at 2-16 (scripts/bench_cpu_ops.py). Here each thread streams its own
// stretch of W's rows once: four W rows at a time, against four x rows at a time (which stay in cache),
// sixteen dot products accumulating in vector registers.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>
#include <optional>

#include "checks.h"

namespace {

constexpr int64_t kRowsPerTask = 64;  // of W: a thread's stretch is a few such runs of 4

// A vector register of floats, as wide as this CPU's (the build is for it: -march=native).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

// Dot products of x rows [m0, m0 + MB) with W rows [n, n + NB), into y: MB * NB vector accumulators.
template <int MB, int NB>
void block(const float* x, const float* w, float* y, int64_t k_len, int64_t n_total, int64_t m0, int64_t n) {
  Vec acc[MB][NB] = {};
  int64_t k = 0;
  for (; k + kLanes <= k_len; k += kLanes) {
    Vec ws[NB];
    for (int j = 0; j < NB; ++j) ws[j] = load(w + (n + j) * k_len + k);
    for (int i = 0; i < MB; ++i) {
      const Vec xv = load(x + (m0 + i) * k_len + k);
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * ws[j];
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      float sum = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) sum += acc[i][j][lane];
      for (int64_t r = k; r < k_len; ++r) sum += x[(m0 + i) * k_len + r] * w[(n + j) * k_len + r];
      y[(m0 + i) * n_total + n + j] = sum;
    }
  }
}

template <int NB>
void rows_block(const float* x, const float* w, float* y, int64_t m_len, int64_t k_len, int64_t n_total, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= m_len; m += 4) block<4, NB>(x, w, y, k_len, n_total, m, n);
  switch (m_len - m) {
    case 3: block<3, NB>(x, w, y, k_len, n_total, m, n); break;
    case 2: block<2, NB>(x, w, y, k_len, n_total, m, n); break;
    case 1: block<1, NB>(x, w, y, k_len, n_total, m, n); break;
    default: break;
  }
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias) {
  using pagedserve::check_cpu, pagedserve::check_shape, pagedserve::kAny;
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], not ", x.sizes());
  check_cpu(weight, "weight");
  check_shape(weight, "weight", {kAny, x.size(1)}, "[N, ", x.size(1), "]");
  if (bias) {  // added to y below, where a wrong shape would broadcast
    check_cpu(*bias, "bias");
    check_shape(*bias, "bias", {weight.size(0)}, "[", weight.size(0), "]");
  }
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const int64_t m_len = xc.size(0), k_len = xc.size(1), n_len = wc.size(0);
  auto y = torch::empty({m_len, n_len}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_len, kRowsPerTask, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) rows_block<4>(xp, wp, yp, m_len, k_len, n_len, n);
    for (; n < end; ++n) rows_block<1>(xp, wp, yp, m_len, k_len, n_len, n);
  });
  if (bias) y.add_(*bias);
  return y;
}
