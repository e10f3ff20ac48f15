// y = x W^T (+ bias) in float32, with W packed at load (pagedserve/kernels/cpu_backend.py's pack_linear, one k a
// step): each group of kGroup output rows stored as [K, kGroup], so that one k of the group's outputs lies
// together.
//
// Each k of a row of x is broadcast to every lane and multiplied into W's vectors at that k, so each
// accumulator lane is one output's running sum over k: no horizontal sums, where skinny_linear.cpp, reading W
// as [N, K], ends every dot product in one, and no packing of W at every call, which is what makes MKL slow
// at a few rows. A tile is kTileRows rows of x against a group; the group's [K, kGroup] stays in cache for
// all the tiles that read it, and a thread takes whole groups. On an AMD EPYC with AVX2 alone, SmolLM2's 120
// GEMMs took 14.6 / 24.2 / 47.4 / 330.9 ms at 1 / 12 / 32 / 256 rows, against skinny_linear's 16.7 / 38.0 /
// 79.7 / 642.3 and MKL's 28.8 / 52.7 / 77.1 / 376.8 on the same weights unpacked (scripts/bench_cpu_ops.py).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "checks.h"
#include "floats.h"

namespace {

using pagedserve::kLanes, pagedserve::load, pagedserve::Vec;

// A group's outputs, its [K, group] read in one pass by each tile: two vectors (16 floats with AVX2, 32 with
// AVX-512), so that a step of k is whole cache lines, and a tile's accumulators, kTileRows of x by two,
// leave registers for the two vectors of W and x's broadcast.
constexpr int kVectors = 2;
constexpr int64_t kGroup = kVectors * kLanes;
constexpr int kTileRows = kLanes == 16 ? 12 : 6;
constexpr int64_t kAskAheadRows = 4;  // see packed_float_linear

// x rows [0, MR) against a group's outputs [n0, n0 + kGroup) (w: its [K, kGroup]), into y; outputs from n_len
// on are the group's zero padding, and are not stored. next, if not null: the [K, kGroup] to ask the caches
// for meanwhile, one k's lines a step.
template <int MR>
void tile(const float* x, const float* w, const float* bias, float* y, int64_t k_len, int64_t n0, int64_t n_len,
          const float* next) {
  Vec acc[MR][kVectors] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    if (next) {
      for (int64_t line = 0; line < kGroup; line += 64 / sizeof(float)) {
        __builtin_prefetch(next + k * kGroup + line, 0, 3);
      }
    }
    Vec ws[kVectors];
    for (int v = 0; v < kVectors; ++v) ws[v] = load(w + k * kGroup + v * kLanes);
    for (int i = 0; i < MR; ++i) {
      const Vec xv = Vec{} + x[i * k_len + k];
      for (int v = 0; v < kVectors; ++v) acc[i][v] += xv * ws[v];
    }
  }
  // Element by element (a copy of acc through memory would keep acc in memory in the loop above, too).
  const int64_t width = std::min(kGroup, n_len - n0);
  for (int i = 0; i < MR; ++i) {
    float* row = y + i * n_len + n0;
    for (int64_t j = 0; j < width; ++j) {
      row[j] = acc[i][j / kLanes][j % kLanes] + (bias ? bias[n0 + j] : 0.0f);
    }
  }
}

// Every row of x against the group of outputs from n0; the first tile asks for next (see tile()).
void column(const float* x, const float* w, const float* bias, float* y, int64_t m_len, int64_t k_len, int64_t n0,
            int64_t n_len, const float* next) {
  int64_t m = 0;
  for (; m + kTileRows <= m_len; m += kTileRows, next = nullptr) {
    tile<kTileRows>(x + m * k_len, w, bias, y + m * n_len, k_len, n0, n_len, next);
  }
  const float* xr = x + m * k_len;
  float* yr = y + m * n_len;
  switch (m_len - m) {
    case 11: tile<11>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 10: tile<10>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 9: tile<9>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 8: tile<8>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 7: tile<7>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 6: tile<6>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 5: tile<5>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 4: tile<4>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 3: tile<3>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 2: tile<2>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    case 1: tile<1>(xr, w, bias, yr, k_len, n0, n_len, next); break;
    default: break;
  }
}

}  // namespace

int64_t packed_float_group() { return kGroup; }

torch::Tensor packed_float_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                                  int64_t n_len) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_shape;
  check_cpu(x, "x", torch::kFloat32);
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], not ", x.sizes());
  const int64_t m_len = x.size(0), k_len = x.size(1), groups = (n_len + kGroup - 1) / kGroup;
  check_cpu(packed, "packed", torch::kFloat32);
  check_shape(packed, "packed", {groups, k_len, kGroup, 1}, "[", groups, ", ", k_len, ", ", kGroup, ", 1]");
  check_contiguous(packed, "packed");
  if (bias) {
    check_cpu(*bias, "bias", torch::kFloat32);
    check_shape(*bias, "bias", {n_len}, "[", n_len, "]");
    check_contiguous(*bias, "bias");
  }
  const auto xc = x.contiguous();
  auto y = torch::empty({m_len, n_len}, x.options());
  const float* xd = xc.data_ptr<float>();
  const float* wd = packed.data_ptr<float>();
  const float* bd = bias ? bias->data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  // A decode step's few rows read each group once, from memory: the first tile of each group asks for the
  // thread's next group, so that its reads overlap this one's arithmetic. SmolLM2's 120 GEMMs at 4 / 6 / 12 /
  // 19 rows took 15.7 / 15.2 / 23.1 / 33.9 ms so, against 17.8 / 17.6 / 26.5 / 36.0 without (the AVX2 EPYC, one
  // run), and the same at 32 rows and up; below 4 rows, where loads bound the loop and the hardware's
  // prefetcher keeps up, it was slower.
  const bool ask_ahead = m_len >= kAskAheadRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const float* next = ask_ahead && group + 1 < end ? wd + (group + 1) * k_len * kGroup : nullptr;
      column(xd, wd + group * k_len * kGroup, bd, yd, m_len, k_len, group * kGroup, n_len, next);
    }
  });
  return y;
}
