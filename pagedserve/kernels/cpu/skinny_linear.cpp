// y = x W^T * scale (+ bias) for the few rows of a decode step: x [M, K], W [N, K], scale and bias [N], M
// small. x and y are float32 or bfloat16; W is x's dtype, or int8 or float8 (e4m3) with a float32 scale per
// row (a quantized linear layer's); the sums are float32, and y is rounded once.
//
// With few rows a GEMM is bound by reading W from memory, once a step; MKL's small-M path reads it well at
// M = 1 but is far from that bound at 2-16 (scripts/bench_cpu_ops.py). Here each thread streams its own
// stretch of W's rows once, widening them to float32 in registers: four W rows at a time, against four x rows
// at a time (which stay in cache, as float32), sixteen dot products accumulating in vector registers. An int8
// weight is a quarter of float32's bytes to read. On a CPU with AVX512-BF16 (which the worker ran before
// choosing it: pagedserve/kernels/cpu_features.py), a bfloat16 model's weights are packed at load for
// packed_linear.cpp instead, which is faster at every number of rows.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "floats.h"

namespace {

using pagedserve::from_float, pagedserve::kLanes, pagedserve::load, pagedserve::sum_lanes, pagedserve::to_float;
using pagedserve::bf16, pagedserve::Vec;

constexpr int64_t kRowsPerTask = 64;  // of W: a thread's stretch is a few such runs of 4

// What the rows of y are made of: x as float32, and W with its scale and bias (float32, or null).
template <typename W, typename Y>
struct Operands {
  const float* x;
  const W* w;
  const float* scale;
  const float* bias;
  Y* y;
  int64_t k_len, n_total;
};

// Dot products of x rows [m0, m0 + MB) with W rows [n, n + NB), into y: MB * NB vector accumulators. w
// points at W's row n: o.w's own, or the same rows widened to float32.
template <int MB, int NB, typename W, typename V, typename Y>
void block(const Operands<W, Y>& o, const V* w, int64_t m0, int64_t n) {
  Vec acc[MB][NB] = {};
  const int64_t k_len = o.k_len;
  int64_t k = 0;
  for (; k + kLanes <= k_len; k += kLanes) {
    Vec ws[NB];
    for (int j = 0; j < NB; ++j) ws[j] = load(w + j * k_len + k);
    for (int i = 0; i < MB; ++i) {
      const Vec xv = load(o.x + (m0 + i) * k_len + k);
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * ws[j];
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      float sum = sum_lanes(acc[i][j]);
      for (int64_t r = k; r < k_len; ++r) sum += o.x[(m0 + i) * k_len + r] * to_float(w[j * k_len + r]);
      if (o.scale) sum *= o.scale[n + j];
      if (o.bias) sum += o.bias[n + j];
      o.y[(m0 + i) * o.n_total + n + j] = from_float<Y>(sum);
    }
  }
}

template <int NB, typename W, typename V, typename Y>
void rows_block(const Operands<W, Y>& o, const V* w, int64_t m_len, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= m_len; m += 4) block<4, NB>(o, w, m, n);
  switch (m_len - m) {
    case 3: block<3, NB>(o, w, m, n); break;
    case 2: block<2, NB>(o, w, m, n); break;
    case 1: block<1, NB>(o, w, m, n); break;
    default: break;
  }
}

// W rows [n, n + NB) against every x row. Where more than one block of x rows reads them, W rows that are
// not float32 are widened once, into wide (a thread's), not once a block.
template <int NB, typename W, typename Y>
void rows(const Operands<W, Y>& o, int64_t m_len, int64_t n, std::vector<float>& wide) {
  const W* w = o.w + n * o.k_len;
  if (std::is_same_v<W, float> || m_len <= 4) {
    rows_block<NB>(o, w, m_len, n);
    return;
  }
  wide.resize(NB * o.k_len);
  for (int64_t i = 0; i < NB * o.k_len; ++i) wide[i] = to_float(w[i]);
  rows_block<NB>(o, wide.data(), m_len, n);
}

template <typename W, typename Y>
void run(const Operands<W, Y>& o, int64_t m_len) {
  at::parallel_for(0, o.n_total, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> wide;
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) rows<4>(o, m_len, n, wide);
    for (; n < end; ++n) rows<1>(o, m_len, n, wide);
  });
}

void check(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
           const std::optional<at::Tensor>& bias) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_cpu_float, pagedserve::check_shape,
      pagedserve::kAny;
  check_cpu_float(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], not ", x.sizes());
  const auto kind = weight.scalar_type();
  const bool quantized = kind == at::kChar || kind == at::kFloat8_e4m3fn;
  check_cpu(weight, "weight", quantized ? kind : x.scalar_type());
  check_shape(weight, "weight", {kAny, x.size(1)}, "[N, ", x.size(1), "]");
  const int64_t n_len = weight.size(0);
  TORCH_CHECK_VALUE(scale.has_value() == quantized, quantized ? "an int8 or float8 weight needs a scale" :
                    "a scale goes with an int8 or float8 weight only");
  if (scale) {
    check_cpu(*scale, "scale");
    check_shape(*scale, "scale", {n_len}, "[", n_len, "]");
    check_contiguous(*scale, "scale");
  }
  if (bias) {
    check_cpu(*bias, "bias", bias->scalar_type() == at::kFloat ? at::kFloat : x.scalar_type());
    check_shape(*bias, "bias", {n_len}, "[", n_len, "]");
  }
}

}  // namespace

at::Tensor skinny_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> scale,
                         std::optional<at::Tensor> bias) {
  check(x, weight, scale, bias);
  const auto wc = weight.contiguous();
  const auto bf = bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  const int64_t m_len = x.size(0), k_len = x.size(1), n_len = wc.size(0);
  auto y = at::empty({m_len, n_len}, x.options());
  const float* scale_data = scale ? scale->data_ptr<float>() : nullptr;
  const float* bias_data = bf ? bf->data_ptr<float>() : nullptr;
  const auto xf = x.to(at::kFloat).contiguous();
  pagedserve::with_float_type(x, "x", [&](auto y_tag) {
    using Y = decltype(y_tag);
    auto go = [&](auto* w) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
      run(Operands<W, Y>{xf.data_ptr<float>(), w, scale_data, bias_data, y.data_ptr<Y>(), k_len, n_len}, m_len);
    };
    switch (wc.scalar_type()) {
      case at::kChar: go(wc.data_ptr<int8_t>()); break;
      case at::kFloat8_e4m3fn: go(wc.data_ptr<pagedserve::fp8>()); break;
      default: go(wc.data_ptr<Y>()); break;  // x's dtype, as check() made sure
    }
  });
  return y;
}
