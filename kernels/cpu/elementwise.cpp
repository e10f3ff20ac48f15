// The per-token elementwise steps of a layer, each one pass over its rows with no temporaries, as the torch
// reference computes them (kernels/torch_ref.py): RMSNorm with the residual add, rotary embedding, and the
// SiLU gate. float32 CPU tensors; x, q and k with a contiguous last dimension (checks.h checks them all).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "checks.h"

using pagedserve::check_cpu;
using pagedserve::check_rows;
using pagedserve::check_shape;
using pagedserve::kAny;

namespace {

constexpr int64_t kRowsPerTask = 16;  // small steps run on one thread: waking the others costs more

}  // namespace

// x [T, H] or [T, heads, D], weight [its last size] (+ residual, shaped like x) -> (weight * x / rms(x), x):
// x is residual + x where a residual is given.
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                   std::optional<torch::Tensor> residual) {
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, "x must be [T, H] or [T, heads, D], not ", x.sizes());
  check_rows(x, "x");
  check_cpu(weight, "weight");
  check_shape(weight, "weight", {x.size(-1)}, "[", x.size(-1), "]");
  if (residual) {
    check_cpu(*residual, "residual");
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes(), "residual must be ", x.sizes(), " like x, not ",
                      residual->sizes());
  }
  const auto shape = x.sizes().vec();
  x = x.contiguous().view({-1, x.size(-1)});
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto summed = residual ? torch::empty_like(x) : x;
  auto normed = torch::empty_like(x);
  const auto res = residual ? residual->contiguous().view({-1, hidden}) : x;
  const auto w = weight.contiguous();
  const float* in = x.data_ptr<float>();
  const float* add = res.data_ptr<float>();
  const float* scale = w.data_ptr<float>();
  float* sum_out = summed.data_ptr<float>();
  float* out = normed.data_ptr<float>();
  const bool has_residual = residual.has_value();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* a = in + r * hidden;
      const float* b = add + r * hidden;
      float* s = sum_out + r * hidden;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = has_residual ? a[i] + b[i] : a[i];
        s[i] = v;
        squares += v * v;
      }
      const float inv = 1.0f / std::sqrt(squares / hidden + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) out[r * hidden + i] = scale[i] * (s[i] * inv);
    }
  });
  return {normed.view(shape), summed.view(shape)};
}

// Rotary embedding, half-split, of one [T, heads, D] tensor in place (rows may be strided, as a split of the
// fused QKV output is): table [max_pos, 2, D] and pos [T] contiguous, as rotary() checked and made them.
void rotary_in_place(torch::Tensor& x, const torch::Tensor& pos, const torch::Tensor& table) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const float* cs = table.data_ptr<float>();
  const int64_t* at_pos = pos.data_ptr<int64_t>();
  float* data = x.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cs + at_pos[t] * 2 * dim;
      const float* sin = cos + dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* row = data + t * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float first = row[i], second = row[i + half];
          row[i] = first * cos[i] - second * sin[i];
          row[i + half] = second * cos[i + half] + first * sin[i + half];
        }
      }
    }
  });
}

// q [T, Hq, D] and k [T, Hkv, D] rotated in place by positions [T] (int64); cos_sin [max_pos, 2, D].
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                                                torch::Tensor cos_sin) {
  check_cpu(q, "q");
  check_shape(q, "q", {kAny, kAny, kAny}, "[T, heads, D]");
  check_rows(q, "q");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK_VALUE(dim % 2 == 0, "q's head dim must be even, not ", dim);
  check_cpu(k, "k");
  check_shape(k, "k", {tokens, kAny, dim}, "[", tokens, ", heads, ", dim, "]");
  check_rows(k, "k");
  check_cpu(positions, "positions", torch::kInt64);
  check_shape(positions, "positions", {tokens}, "[", tokens, "]");
  check_cpu(cos_sin, "cos_sin");
  check_shape(cos_sin, "cos_sin", {kAny, 2, dim}, "[N, 2, ", dim, "]");
  const auto pos = positions.contiguous();
  const auto table = cos_sin.contiguous();
  const int64_t* at_pos = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // before any row turns, so that a refused call changes nothing
    TORCH_CHECK(at_pos[t] >= 0 && at_pos[t] < table.size(0), "position ", at_pos[t], " is past the rotary table");
  }
  rotary_in_place(q, pos, table);
  rotary_in_place(k, pos, table);
  return {q, k};
}

// x [T, 2I] -> silu(x[:, :I]) * x[:, I:]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 I], not ", x.sizes());
  check_rows(x, "x");
  x = x.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = torch::empty({rows, inner}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * inner;
      const float* up = gate + inner;
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) o[r * inner + i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}
