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
//
// Gated, W is a fused gate and up projection [2 I, K] (I a multiple of kGroup): each tile runs a group of
// gate's rows, keeps its sums, then the group of up's rows I after them, and writes y [M, I] = silu(gate) *
// up as silu_and_mul would (elementwise.cpp, the same function), so that the [M, 2 I] product is never
// written and read back.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>

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

// x rows [0, MR) against a group's [K, kGroup] at w: out(i, j, sum) takes row i's sum for the group's output
// j. next, if not null: a [K, kGroup] to ask the caches for meanwhile, one k's lines a step.
template <int MR, typename Out>
void tile(const float* x, const float* w, int64_t k_len, const float* next, Out&& out) {
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
  for (int i = 0; i < MR; ++i) {
    for (int64_t j = 0; j < kGroup; ++j) out(i, j, acc[i][j / kLanes][j % kLanes]);
  }
}

// block(rows, m) for each tile of x's m_len rows: rows (a std::integral_constant) from row m on.
template <typename Block>
void for_each_tile(int64_t m_len, Block&& block) {
  int64_t m = 0;
  for (; m + kTileRows <= m_len; m += kTileRows) block(std::integral_constant<int, kTileRows>{}, m);
  switch (m_len - m) {
    case 11: block(std::integral_constant<int, 11>{}, m); break;
    case 10: block(std::integral_constant<int, 10>{}, m); break;
    case 9: block(std::integral_constant<int, 9>{}, m); break;
    case 8: block(std::integral_constant<int, 8>{}, m); break;
    case 7: block(std::integral_constant<int, 7>{}, m); break;
    case 6: block(std::integral_constant<int, 6>{}, m); break;
    case 5: block(std::integral_constant<int, 5>{}, m); break;
    case 4: block(std::integral_constant<int, 4>{}, m); break;
    case 3: block(std::integral_constant<int, 3>{}, m); break;
    case 2: block(std::integral_constant<int, 2>{}, m); break;
    case 1: block(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

struct Operands {
  const float* x;
  const float* w;  // [groups, K, kGroup]
  const float* bias;
  float* y;
  int64_t m_len, k_len, n_len;
  const float* group(int64_t g) const { return w + g * k_len * kGroup; }
};

// Every row of x against group g, into y [M, N]; the first tile asks for next.
void column(const Operands& o, int64_t g, const float* next) {
  const int64_t n0 = g * kGroup, width = std::min(kGroup, o.n_len - n0);  // from width on: the group's padding
  for_each_tile(o.m_len, [&](auto rows, int64_t m) {
    float* y = o.y + m * o.n_len + n0;
    tile<decltype(rows)::value>(o.x + m * o.k_len, o.group(g), o.k_len, m == 0 ? next : nullptr,
                                [&](int i, int64_t j, float sum) {
                                  if (j < width) y[i * o.n_len + j] = sum + (o.bias ? o.bias[n0 + j] : 0.0f);
                                });
  });
}

// Every row of x against gate's group g and up's group g + I / kGroup, into y [M, I] = silu(gate) * up; the
// first tile asks for the next pair (next: its gate group).
void gated_column(const Operands& o, int64_t g, const float* next) {
  const int64_t inner = o.n_len / 2, n0 = g * kGroup, up = g + inner / kGroup;
  const float* next_up = next ? next + inner * o.k_len : nullptr;
  for_each_tile(o.m_len, [&](auto rows, int64_t m) {
    constexpr int kRows = decltype(rows)::value;
    const float* x = o.x + m * o.k_len;
    float gates[kRows][kGroup], ups[kRows][kGroup];
    tile<kRows>(x, o.group(g), o.k_len, m == 0 ? next : nullptr, [&](int i, int64_t j, float sum) {
      gates[i][j] = sum + (o.bias ? o.bias[n0 + j] : 0.0f);
    });
    tile<kRows>(x, o.group(up), o.k_len, m == 0 ? next_up : nullptr, [&](int i, int64_t j, float sum) {
      ups[i][j] = sum + (o.bias ? o.bias[inner + n0 + j] : 0.0f);
    });
    // A row of the group at once, vectorized as silu_and_mul's loop is (elementwise.cpp), whose vector exp
    // differs from the scalar one in the last bit.
    for (int i = 0; i < kRows; ++i) {
      float* y = o.y + (m + i) * inner + n0;
#pragma omp simd
      for (int64_t j = 0; j < kGroup; ++j) y[j] = pagedserve::silu_mul<float>(gates[i][j], ups[i][j]);
    }
  });
}

}  // namespace

int64_t packed_float_group() { return kGroup; }

at::Tensor packed_float_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias, int64_t n_len,
                               bool gated) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_shape;
  check_cpu(x, "x", at::kFloat);
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], not ", x.sizes());
  const int64_t m_len = x.size(0), k_len = x.size(1), groups = (n_len + kGroup - 1) / kGroup;
  check_cpu(packed, "packed", at::kFloat);
  check_shape(packed, "packed", {groups, k_len, kGroup, 1}, "[", groups, ", ", k_len, ", ", kGroup, ", 1]");
  check_contiguous(packed, "packed");
  TORCH_CHECK_VALUE(!gated || n_len % (2 * kGroup) == 0, "a gated weight's gate and up rows must each be a multiple of ",
                    kGroup, ", not ", n_len, " / 2");
  if (bias) {
    check_cpu(*bias, "bias", at::kFloat);
    check_shape(*bias, "bias", {n_len}, "[", n_len, "]");
    check_contiguous(*bias, "bias");
  }
  const auto xc = x.contiguous();
  auto y = at::empty({m_len, gated ? n_len / 2 : n_len}, x.options());
  const Operands o{xc.data_ptr<float>(), packed.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                   y.data_ptr<float>(), m_len, k_len, n_len};
  // A decode step's few rows read each group once, from memory: the first tile of each group asks for the
  // thread's next group, so that its reads overlap this one's arithmetic. SmolLM2's 120 GEMMs at 4 / 6 / 12 /
  // 19 rows took 15.7 / 15.2 / 23.1 / 33.9 ms so, against 17.8 / 17.6 / 26.5 / 36.0 without (the AVX2 EPYC, one
  // run), and the same at 32 rows and up; below 4 rows, where loads bound the loop and the hardware's
  // prefetcher keeps up, it was slower.
  const bool ask_ahead = m_len >= kAskAheadRows;
  const int64_t items = gated ? groups / 2 : groups;  // gated, each runs gate's group and up's
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* next = ask_ahead && g + 1 < end ? o.group(g + 1) : nullptr;
      if (gated) {
        gated_column(o, g, next);
      } else {
        column(o, g, next);
      }
    }
  });
  return y;
}
