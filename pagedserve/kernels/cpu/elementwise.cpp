// The per-token elementwise steps of a layer, each one pass over its rows with no temporaries, as the torch
// reference computes them (pagedserve/kernels/torch_ref.py): RMSNorm with the residual add, rotary embedding, and the
// SiLU gate. float32 or bfloat16 CPU tensors, computed in float32 and rounded to the tensors' dtype where
// transformers rounds; x, q and k with a contiguous last dimension (checks.h checks them all).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "checks.h"
#include "floats.h"

using pagedserve::check_cpu;
using pagedserve::check_cpu_float;
using pagedserve::check_rows;
using pagedserve::check_shape;
using pagedserve::from_float;
using pagedserve::kAny;
using pagedserve::round_to;
using pagedserve::silu_mul;
using pagedserve::to_float;
using pagedserve::with_float_type;

namespace {

constexpr int64_t kRowsPerTask = 16;  // small steps run on one thread: waking the others costs more

// rows of x (+ add) -> sums and normed rows, [rows, hidden] each.
template <typename T>
void rms_norm_rows(const T* in, const T* add, const T* scale, T* sum_out, T* out, int64_t rows, int64_t hidden,
                   float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = in + r * hidden;
      const T* b = add ? add + r * hidden : nullptr;
      T* s = sum_out + r * hidden;
      float squares = 0.0f;
      if (b) {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; ++i) {
          const float v = round_to<T>(to_float(a[i]) + to_float(b[i]));
          s[i] = from_float<T>(v);
          squares += v * v;
        }
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; ++i) {
          const float v = to_float(a[i]);
          squares += v * v;
        }
      }
      const float inv = 1.0f / std::sqrt(squares / hidden + eps);
      const T* summed = b ? s : a;
      T* o = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        o[i] = from_float<T>(to_float(scale[i]) * round_to<T>(to_float(summed[i]) * inv));
      }
    }
  });
}

// Rotary embedding, half-split, of one [T, heads, D] tensor in place (rows may be strided, as a split of the
// fused QKV output is): table [max_pos, 2, D] and pos [T] contiguous, as rotary() checked and made them.
template <typename T>
void rotary_in_place(at::Tensor& x, const at::Tensor& pos, const at::Tensor& table) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const T* cs = table.data_ptr<T>();
  const int64_t* at_pos = pos.data_ptr<int64_t>();
  T* data = x.data_ptr<T>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = cs + at_pos[t] * 2 * dim;
      const T* sin = cos + dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = data + t * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float first = to_float(row[i]), second = to_float(row[i + half]);
          // q * cos + rotate_half(q) * sin, each product rounded as transformers rounds it
          row[i] = from_float<T>(round_to<T>(first * to_float(cos[i])) - round_to<T>(second * to_float(sin[i])));
          row[i + half] =
              from_float<T>(round_to<T>(second * to_float(cos[i + half])) + round_to<T>(first * to_float(sin[i + half])));
        }
      }
    }
  });
}

template <typename T>
void silu_rows(const T* in, T* o, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * inner;
      const T* up = gate + inner;
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) o[r * inner + i] = silu_mul<T>(to_float(gate[i]), to_float(up[i]));
    }
  });
}

}  // namespace

// x [T, H] or [T, heads, D], weight [its last size] (+ residual, shaped like x) -> (weight * x / rms(x), x):
// x is residual + x where a residual is given.
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                            std::optional<at::Tensor> residual) {
  check_cpu_float(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, "x must be [T, H] or [T, heads, D], not ", x.sizes());
  check_rows(x, "x");
  check_cpu(weight, "weight", x.scalar_type());
  check_shape(weight, "weight", {x.size(-1)}, "[", x.size(-1), "]");
  if (residual) {
    check_cpu(*residual, "residual", x.scalar_type());
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes(), "residual must be ", x.sizes(), " like x, not ",
                      residual->sizes());
  }
  const auto shape = x.sizes().vec();
  x = x.contiguous().view({-1, x.size(-1)});
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto summed = residual ? at::empty_like(x) : x;
  auto normed = at::empty_like(x);
  const auto res = residual ? residual->contiguous().view({-1, hidden}) : x;
  const auto w = weight.contiguous();
  with_float_type(x, "x", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows(x.data_ptr<T>(), residual ? res.data_ptr<T>() : nullptr, w.data_ptr<T>(), summed.data_ptr<T>(),
                  normed.data_ptr<T>(), rows, hidden, static_cast<float>(eps));
  });
  return {normed.view(shape), summed.view(shape)};
}

// q [T, Hq, D] and k [T, Hkv, D] rotated in place by positions [T] (int64); cos_sin [max_pos, 2, D], of q's
// dtype.
std::tuple<at::Tensor, at::Tensor> rotary(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin) {
  check_cpu_float(q, "q");
  check_shape(q, "q", {kAny, kAny, kAny}, "[T, heads, D]");
  check_rows(q, "q");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK_VALUE(dim % 2 == 0, "q's head dim must be even, not ", dim);
  check_cpu(k, "k", q.scalar_type());
  check_shape(k, "k", {tokens, kAny, dim}, "[", tokens, ", heads, ", dim, "]");
  check_rows(k, "k");
  check_cpu(positions, "positions", at::kLong);
  check_shape(positions, "positions", {tokens}, "[", tokens, "]");
  check_cpu(cos_sin, "cos_sin", q.scalar_type());
  check_shape(cos_sin, "cos_sin", {kAny, 2, dim}, "[N, 2, ", dim, "]");
  const auto pos = positions.contiguous();
  const auto table = cos_sin.contiguous();
  const int64_t* at_pos = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // before any row turns, so that a refused call changes nothing
    TORCH_CHECK(at_pos[t] >= 0 && at_pos[t] < table.size(0), "position ", at_pos[t], " is past the rotary table");
  }
  with_float_type(q, "q", [&](auto tag) {
    using T = decltype(tag);
    rotary_in_place<T>(q, pos, table);
    rotary_in_place<T>(k, pos, table);
  });
  return {q, k};
}

// x [T, 2I] -> silu(x[:, :I]) * x[:, I:]
at::Tensor silu_and_mul(at::Tensor x) {
  check_cpu_float(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 I], not ", x.sizes());
  check_rows(x, "x");
  x = x.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty({rows, inner}, x.options());
  with_float_type(x, "x", [&](auto tag) {
    using T = decltype(tag);
    silu_rows(x.data_ptr<T>(), out.data_ptr<T>(), rows, inner);
  });
  return out;
}
