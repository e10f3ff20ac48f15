// The per-token elementwise steps of a layer, each one pass over its rows with no temporaries, as the torch
// reference computes them (kernels/torch_ref.py): RMSNorm with the residual add, rotary embedding, and the
// SiLU gate. float32; each tensor's last dimension contiguous.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <optional>
#include <cmath>
#include <tuple>

namespace {

constexpr int64_t kRowsPerTask = 16;  // small steps run on one thread: waking the others costs more

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.stride(-1) == 1, name,
              " must be float32 with a contiguous last dimension");
}

}  // namespace

// x [T, H] (+ residual [T, H]) -> (weight * x / rms(x), x): x is residual + x where a residual is given.
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                   std::optional<torch::Tensor> residual) {
  check_rows(x, "x");
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
// fused QKV output is): cos_sin [max_pos, 2, D], positions [T] int64.
void rotary_in_place(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos_sin) {
  check_rows(x, "q and k");
  TORCH_CHECK(x.dim() == 3 && positions.size(0) == x.size(0) && cos_sin.size(2) == x.size(2),
              "q and k must be [T, heads, D] with a position each and the rotary table's D");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const auto table = cos_sin.contiguous();
  const auto pos = positions.contiguous();
  const float* cs = table.data_ptr<float>();
  const int64_t* at_pos = pos.data_ptr<int64_t>();
  float* data = x.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1), max_pos = table.size(0);
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(at_pos[t] >= 0 && at_pos[t] < max_pos, "position ", at_pos[t], " is past the rotary table");
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

std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                                                torch::Tensor cos_sin) {
  rotary_in_place(q, positions, cos_sin);
  rotary_in_place(k, positions, cos_sin);
  return {q, k};
}

// x [T, 2I] -> silu(x[:, :I]) * x[:, I:]
torch::Tensor silu_and_mul(torch::Tensor x) {
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
