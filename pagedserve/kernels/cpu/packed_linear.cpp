// y = x W^T * scale (+ bias) with a weight packed at load (pagedserve/kernels/cpu_backend.py packs) for one
// instruction that multiplies several consecutive k at once (or, gated, silu(x Wg^T) * x Wu^T of a fused gate
// and up projection, in the same pass over x):
// - a bfloat16 W for vdpbf16ps (AVX512-BF16), bfloat16 x: two k, each group of 32 output rows stored as
//   [K/2, 32, 2];
// - an int8 W, with a float32 scale per output row, for vpdpbusd (AVX512-VNNI), bfloat16 or float32 x: four
//   k, [K/4, 32, 4]; x is rounded per row to int8 first (a scale a row, max |x| / 127), the products summed
//   exactly in int32. With float32 x nothing in the path is a bfloat16 instruction, so it runs on a CPU with
//   VNNI and no AVX512-BF16 (Cascade Lake, Ice Lake); y is x's dtype.
// Either way one 512-bit load holds those k of 16 outputs (the last group is padded with zero rows).
//
// Each of x's steps of k is broadcast to all 16 lanes, so each accumulator lane is one output's running
// sum over k: no horizontal sums, where skinny_linear.cpp, reading W as [N, K], ends every dot product in
// one. A tile is up to 12 x rows against a group's 32 outputs (24 accumulators); a group's W is read once
// for all the tiles a thread runs against it. scripts/bench_quantized.py times it: at one row it reads W at
// close to the machine's memory rate; in bfloat16 it is faster than oneDNN's GEMM on unpacked weights at
// every number of rows it measured, and int8 x int8 is faster again (twice the products an instruction).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "checks.h"
#include "floats.h"

namespace {

using pagedserve::bf16;
#if defined(__x86_64__)
namespace amx = pagedserve::amx;
#endif

constexpr int64_t kGroup = 32;    // outputs a group packs: two 16-lane accumulators
constexpr int64_t kTileRows = 12;  // x rows a tile: 24 accumulators of the 32 vector registers
constexpr int64_t kStepBytes = 128;  // a step of k of a group's W: two 512-bit vectors

#if defined(__x86_64__)
#define PACKED_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

struct Operands {
  const void* x;         // [M, K]: bfloat16, or uint8 (quantized rows, offset by 128)
  const float* x_scale;  // [M], for uint8 x
  const void* w;         // [G, K / kStep, 32, kStep]
  const int32_t* w_sums;  // [G * 32]: 128 * each output's sum of W, for int8 x int8
  const float* scale;    // [N] or null
  const float* bias;     // [N] or null
  void* y;               // [M, N], bfloat16 or float32 as x
  int64_t k_len, n_len;
};

// Each Dot is one instruction's way to multiply: kStep consecutive k of 32 outputs are kStepBytes of W
// (outputs 0-15, then 16-31), and kStep consecutive k of a row of x are 4 bytes, broadcast to all 16 lanes.

// bfloat16 x and W: vdpbf16ps.
struct Bf16Dot {
  using X = bf16;
  using Acc = __m512;
  static constexpr int64_t kStep = 2;
  PACKED_TARGET static Acc zero() { return _mm512_setzero_ps(); }
  PACKED_TARGET static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  PACKED_TARGET static void load(const void* w, __m512i& lo, __m512i& hi) {
    lo = _mm512_loadu_si512(w);
    hi = _mm512_loadu_si512(static_cast<const char*>(w) + 64);
  }
  PACKED_TARGET static Acc dot(Acc acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
  PACKED_TARGET static __m512 sums(Acc acc, const Operands&, int64_t, int64_t) { return acc; }
};

// x quantized per row to int8 and offset by 128 (vpdpbusd multiplies unsigned by signed bytes), int8 W: the
// int32 sums less 128 * the output's sum of W are the int8 dot products, exactly; then x's row scale.
struct Int8Dot {
  using X = uint8_t;
  // vpdpbusd's own lanes (int32), not __m512i's (int64): with the latter, GCC spills the tile's sums to the
  // stack every step.
  typedef int32_t Acc __attribute__((vector_size(64)));
  static constexpr int64_t kStep = 4;
  PACKED_TARGET static Acc zero() { return Acc{}; }
  PACKED_TARGET static Acc add(Acc a, Acc b) { return a + b; }
  PACKED_TARGET static void load(const void* w, __m512i& lo, __m512i& hi) { Bf16Dot::load(w, lo, hi); }
  PACKED_TARGET static Acc dot(Acc acc, __m512i x, __m512i w) { return (Acc)_mm512_dpbusd_epi32((__m512i)acc, x, w); }
  PACKED_TARGET static __m512 sums(Acc acc, const Operands& o, int64_t m, int64_t n0) {
    const __m512i exact = _mm512_sub_epi32((__m512i)acc, _mm512_loadu_si512(o.w_sums + n0));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(o.x_scale[m]));
  }
};

// x's values k .. k + kStep - 1 of a row (4 bytes), in all 16 lanes.
template <typename X>
PACKED_TARGET inline __m512i broadcast(const X* x) {
  int32_t word;
  std::memcpy(&word, x, sizeof word);
  return _mm512_set1_epi32(word);
}

// Outputs [n0, n0 + 16) of W's rows from their sums: scaled and biased (where n < N, which mask marks).
PACKED_TARGET inline __m512 finish(const Operands& o, int64_t n0, __m512 sums, __mmask16 mask = 0xFFFF) {
  if (o.scale) sums = _mm512_mul_ps(sums, _mm512_maskz_loadu_ps(mask, o.scale + n0));
  if (o.bias) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(mask, o.bias + n0));
  return sums;
}

// Where a kernel's sums go, 16 outputs at a time: put(m, n0, sums) takes row m's sums of W's rows
// [n0, n0 + 16), x's scale applied.

// 16 outputs as a Y holds them: rounded to bfloat16 (vcvtneps2bf16), or float32 as they are.
template <typename Y>
PACKED_TARGET inline __m512 as_stored(__m512 v) {
  if constexpr (std::is_same_v<Y, bf16>) return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
  return v;
}

// y = the outputs, as Y (x's dtype), stored where n < N.
template <typename Y>
struct Store {
  const Operands& o;
  PACKED_TARGET void put(int64_t m, int64_t n0, __m512 sums) const {
    const int64_t valid = o.n_len - n0;
    if (valid <= 0) return;
    const __mmask16 mask = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    Y* y = static_cast<Y*>(o.y) + m * o.n_len + n0;
    if constexpr (std::is_same_v<Y, bf16>) {
      _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(finish(o, n0, sums, mask)));
    } else {
      _mm512_mask_storeu_ps(y, mask, finish(o, n0, sums, mask));
    }
  }
};

// Gated, W is [2 I, K]: gate's rows, then up's, I a multiple of the group. A work item runs gate's group g
// for its rows into Gates, as Y holds them (as an unfused projection would store them), then up's group
// (g + I / 32) into GatedStore, which writes y [M, I] = silu(gate) * up, as silu_and_mul rounds it.
constexpr int64_t kMaxStretch = 4 * kTileRows;  // rows a work item: run's 4 tiles, or one of run_amx's blocks

template <typename Y>
struct Gates {
  const Operands& o;
  int64_t m0;                            // the work item's first row
  float (&rows)[kMaxStretch][kGroup];  // its rows' gates
  PACKED_TARGET void put(int64_t m, int64_t n0, __m512 sums) const {
    _mm512_storeu_ps(&rows[m - m0][n0 % kGroup], as_stored<Y>(finish(o, n0, sums)));
  }
};

// glibc's expf of 16 lanes (libmvec, in the x86-64 vector function ABI): what GCC's vectorizer calls for
// std::exp in silu_and_mul's loop (elementwise.cpp) under -ffast-math, so that the two agree bit for bit.
extern "C" __m512 _ZGVeN16v_expf(__m512);

// 16 floats rounded to bfloat16 as pagedserve::from_float rounds one (to nearest, ties to even, in integer
// steps: vcvtneps2bf16 would flush a subnormal to zero), each in its lane's high half.
PACKED_TARGET inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
}

// y [M, I] = silu(gate) * up, 16 outputs at a time, each as pagedserve::silu_mul computes it (and
// silu_and_mul, which calls it). GCC made the loop of 16 calls of it in 256-bit halves: SmolLM2's gated
// product of 2048 rows took 2.9 ms so on an AMX Xeon, 2.7 so.
template <typename Y>
struct GatedStore {
  const Operands& o;
  int64_t m0;
  const float (&gates)[kMaxStretch][kGroup];
  PACKED_TARGET void put(int64_t m, int64_t n0, __m512 sums) const {
    const __m512 up = as_stored<Y>(finish(o, n0, sums));
    const __m512 g = _mm512_max_ps(_mm512_loadu_ps(&gates[m - m0][n0 % kGroup]), _mm512_set1_ps(-88.0f));
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
    __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const int64_t inner = o.n_len / 2;
    Y* to = static_cast<Y*>(o.y) + m * inner + n0 - inner;
    if constexpr (std::is_same_v<Y, bf16>) {
      silu = _mm512_castsi512_ps(bf16_bits(silu));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(_mm512_mul_ps(silu, up)), 16)));
    } else {
      _mm512_storeu_ps(to, _mm512_mul_ps(silu, up));
    }
  }
};

template <typename Dot, typename Sink>
PACKED_TARGET inline void put_both(const Operands& o, const Sink& sink, int64_t m, int64_t n0,
                                   const typename Dot::Acc* acc) {
  sink.put(m, n0, Dot::sums(acc[0], o, m, n0));
  sink.put(m, n0 + 16, Dot::sums(acc[1], o, m, n0 + 16));
}

// Rows [m0, m0 + MB) against group g's W, w.
template <int MB, typename Dot, typename Sink>
PACKED_TARGET void tile(const Operands& o, const Sink& sink, const char* w, int64_t m0, int64_t g) {
  typename Dot::Acc acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = Dot::zero();
  const auto* x = static_cast<const typename Dot::X*>(o.x) + m0 * o.k_len;
  for (int64_t k = 0; k < o.k_len; k += Dot::kStep, w += kStepBytes) {
    __m512i lo, hi;
    Dot::load(w, lo, hi);
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = broadcast(x + i * o.k_len + k);
      acc[i][0] = Dot::dot(acc[i][0], xv, lo);
      acc[i][1] = Dot::dot(acc[i][1], xv, hi);
    }
  }
  for (int i = 0; i < MB; ++i) put_both<Dot>(o, sink, m0 + i, g * kGroup, acc[i]);
}

// One int8 row against group g: four chains of sums over k, so that each dot product waits on one four back.
template <typename Dot, typename Sink>
PACKED_TARGET void single_row(const Operands& o, const Sink& sink, const char* w, int64_t m, int64_t g) {
  constexpr int64_t kStep = Dot::kStep;
  typename Dot::Acc acc[4][2];
  for (auto& chain : acc) chain[0] = chain[1] = Dot::zero();
  const auto* x = static_cast<const typename Dot::X*>(o.x) + m * o.k_len;
  int64_t k = 0;
  for (; k + 4 * kStep <= o.k_len; k += 4 * kStep, w += 4 * kStepBytes) {
    for (int u = 0; u < 4; ++u) {
      __m512i lo, hi;
      Dot::load(w + u * kStepBytes, lo, hi);
      const __m512i xv = broadcast(x + k + u * kStep);
      acc[u][0] = Dot::dot(acc[u][0], xv, lo);
      acc[u][1] = Dot::dot(acc[u][1], xv, hi);
    }
  }
  for (; k < o.k_len; k += kStep, w += kStepBytes) {
    __m512i lo, hi;
    Dot::load(w, lo, hi);
    const __m512i xv = broadcast(x + k);
    acc[0][0] = Dot::dot(acc[0][0], xv, lo);
    acc[0][1] = Dot::dot(acc[0][1], xv, hi);
  }
  typename Dot::Acc total[2];
  for (int half = 0; half < 2; ++half) {
    total[half] = Dot::add(Dot::add(acc[0][half], acc[1][half]), Dot::add(acc[2][half], acc[3][half]));
  }
  put_both<Dot>(o, sink, m, g * kGroup, total);
}

template <typename Dot, typename Sink>
PACKED_TARGET void rows_against_group(const Operands& o, const Sink& sink, int64_t m0, int64_t m_end, int64_t g) {
  const int64_t w_bytes = kStepBytes * (o.k_len / Dot::kStep);  // a group's
  const char* w = static_cast<const char*>(o.w) + g * w_bytes;
  int64_t m = m0;
  // Four chains reorder a float sum: a bfloat16 row then differs by whether it ran alone (a decode step of
  // one sequence) or in a tile. Integer sums are exact in any order.
  if (std::is_same_v<Dot, Int8Dot> && m_end - m == 1) {
    single_row<Dot>(o, sink, w, m, g);
    return;
  }
  for (; m + kTileRows <= m_end; m += kTileRows) tile<kTileRows, Dot>(o, sink, w, m, g);
  switch (m_end - m) {
    case 11: tile<11, Dot>(o, sink, w, m, g); break;
    case 10: tile<10, Dot>(o, sink, w, m, g); break;
    case 9: tile<9, Dot>(o, sink, w, m, g); break;
    case 8: tile<8, Dot>(o, sink, w, m, g); break;
    case 7: tile<7, Dot>(o, sink, w, m, g); break;
    case 6: tile<6, Dot>(o, sink, w, m, g); break;
    case 5: tile<5, Dot>(o, sink, w, m, g); break;
    case 4: tile<4, Dot>(o, sink, w, m, g); break;
    case 3: tile<3, Dot>(o, sink, w, m, g); break;
    case 2: tile<2, Dot>(o, sink, w, m, g); break;
    case 1: tile<1, Dot>(o, sink, w, m, g); break;
    default: break;
  }
}

// The work is (group, stretch of rows) pairs, group-major, so that a thread's consecutive pairs share a
// group's W; a stretch is every row at decode sizes, and 4 tiles of rows at a prefill's.
// The lambdas here name the target themselves: GCC does not pass a function's target to a lambda inside it.
// Gated, a work item is gate's group g with up's after it (groups is then I / 32).
template <typename Dot, typename Y>
void run(const Operands& o, int64_t m_len, int64_t groups, bool gated) {
  const int64_t stretch = m_len <= kMaxStretch ? m_len : kMaxStretch;
  const int64_t stretches = (m_len + stretch - 1) / stretch;
  at::parallel_for(0, groups * stretches, 1, [&](int64_t begin, int64_t end) PACKED_TARGET {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / stretches, m0 = (i % stretches) * stretch, m_end = std::min(m0 + stretch, m_len);
      if (gated) {
        float gates[kMaxStretch][kGroup];
        rows_against_group<Dot>(o, Gates<Y>{o, m0, gates}, m0, m_end, g);
        rows_against_group<Dot>(o, GatedStore<Y>{o, m0, gates}, m0, m_end, g + groups);
      } else {
        rows_against_group<Dot>(o, Store<Y>{o}, m0, m_end, g);
      }
    }
  });
}

// With AMX-INT8, for a prefill's many rows: 32 rows of x against a group's 32 outputs are four tiles of
// int32 sums (tiles 0-3), each a product of x's rows 16 at a time (tiles 4 and 5: 64 k of unsigned bytes) by a
// half of the group (tiles 6 and 7): a step of 4 k of the packing is a 64-byte row of either half, the steps
// 128 bytes apart, which is the layout a tile's right operand takes. The sums end as vpdpbusd's do. x holds a
// multiple of 32 rows (those past M unused) and K is a multiple of 64.
constexpr int64_t kAmxRows = 32, kAmxK = 64;
static_assert(kAmxRows <= kMaxStretch);

// The products of x's rows [m0, m0 + 32) and a group's W, w, summed in tiles 0-3; between_steps() runs after
// each step of 64 k is issued.
template <typename Between>
AMX_TARGET inline void tile_products(const Operands& o, const char* w, int64_t m0, Between between_steps) {
  const auto* x = static_cast<const uint8_t*>(o.x) + m0 * o.k_len;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < o.k_len; k += kAmxK, w += kAmxK / Int8Dot::kStep * kStepBytes) {
    _tile_loadd(4, x + k, o.k_len);
    _tile_loadd(5, x + amx::kRows * o.k_len + k, o.k_len);
    _tile_loadd(6, w, kStepBytes);
    _tile_loadd(7, w + 64, kStepBytes);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
    between_steps();
  }
}

using BlockSums = int32_t[kAmxRows][kGroup];

AMX_TARGET inline void store_tiles(BlockSums& sums) {
  _tile_stored(0, &sums[0][0], kGroup * 4);
  _tile_stored(1, &sums[0][16], kGroup * 4);
  _tile_stored(2, &sums[16][0], kGroup * 4);
  _tile_stored(3, &sums[16][16], kGroup * 4);
}

template <typename Sink>
PACKED_TARGET void put_rows(const Operands& o, const Sink& sink, const BlockSums& sums, int64_t m0, int64_t first,
                            int64_t end, int64_t g) {
  for (int64_t i = first; i < end; ++i) {
    Int8Dot::Acc acc[2];
    std::memcpy(&acc[0], sums[i], sizeof acc[0]);
    std::memcpy(&acc[1], sums[i] + 16, sizeof acc[1]);
    put_both<Int8Dot>(o, sink, m0 + i, g * kGroup, acc);
  }
}

// Rows [m0, m0 + 32) against group g's W, w, into y.
template <typename Y>
AMX_TARGET void amx_block(const Operands& o, const char* w, int64_t m0, int64_t m_end, int64_t g) {
  tile_products(o, w, m0, [] {});
  alignas(64) BlockSums sums;
  store_tiles(sums);
  put_rows(o, Store<Y>{o}, sums, m0, 0, std::min(kAmxRows, m_end - m0), g);
}

// A gated product's blocks, gates then ups for each 32 rows. A block's sums wait for their sink, which takes
// them a few rows at a time between the next block's tile products: the vector units scale, round, take the
// silu and store while the tiles multiply (SmolLM2's gated product of 2048 rows: 2.3 ms, against 2.7 with
// the sinks after the products). A block's gates are taken before its ups are, and its ups before the next
// block's gates, so one block of gates serves.
template <typename Y>
class GatedBlocks {
 public:
  // groups: I / 32; gate's group g is at weights + g * w_bytes, and up's g + groups.
  GatedBlocks(const Operands& o, const char* weights, int64_t w_bytes, int64_t groups)
      : o_(o), weights_(weights), w_bytes_(w_bytes), groups_(groups) {}

  // Rows [m0, m0 + 32) against gate's group g and up's.
  AMX_TARGET void run(int64_t m0, int64_t m_end, int64_t g) {
    const int64_t rows = std::min(kAmxRows, m_end - m0);
    block(m0, rows, g, false);
    block(m0, rows, g + groups_, true);
  }

  PACKED_TARGET void finish() { take(rows_ - done_); }

 private:
  AMX_TARGET void block(int64_t m0, int64_t rows, int64_t g, bool ups) {
    const int64_t steps = o_.k_len / kAmxK, rows_a_step = (rows_ - done_ + steps - 1) / steps;
    tile_products(o_, weights_ + g * w_bytes_, m0, [&]() PACKED_TARGET { take(rows_a_step); });
    finish();
    store_tiles(sums_);
    ups_ = ups, m0_ = m0, rows_ = rows, g_ = g, done_ = 0;
  }

  PACKED_TARGET void take(int64_t rows) {
    const int64_t end = std::min(rows_, done_ + rows);
    if (ups_) {
      put_rows(o_, GatedStore<Y>{o_, m0_, gates_}, sums_, m0_, done_, end, g_);
    } else {
      put_rows(o_, Gates<Y>{o_, m0_, gates_}, sums_, m0_, done_, end, g_);
    }
    done_ = end;
  }

  const Operands& o_;
  const char* weights_;
  int64_t w_bytes_, groups_;
  alignas(64) BlockSums sums_;  // the block in waiting's
  float gates_[kMaxStretch][kGroup];
  bool ups_ = false;
  int64_t m0_ = 0, rows_ = 0, g_ = 0, done_ = 0;  // its rows, group, and the rows taken
};

// As run, with blocks of 32 rows on the tiles; a work item is a group (gated: two) against 4 blocks.
template <typename Y>
void run_amx(const Operands& o, int64_t m_len, int64_t groups, bool gated) {
  constexpr int64_t kStretch = 4;
  const int64_t blocks = (m_len + kAmxRows - 1) / kAmxRows, stretches = (blocks + kStretch - 1) / kStretch;
  const int64_t w_bytes = kStepBytes * (o.k_len / Int8Dot::kStep);  // a group's
  const char* weights = static_cast<const char*>(o.w);
  at::parallel_for(0, groups * stretches, 1, [&](int64_t begin, int64_t end) AMX_TARGET {
    const amx::Tiles tiles(8);
    GatedBlocks<Y> gated_blocks(o, weights, w_bytes, groups);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / stretches, first = (i % stretches) * kStretch;
      for (int64_t b = first; b < std::min(first + kStretch, blocks); ++b) {
        if (gated) {
          gated_blocks.run(b * kAmxRows, m_len, g);
        } else {
          amx_block<Y>(o, weights + g * w_bytes, b * kAmxRows, m_len, g);
        }
      }
    }
    gated_blocks.finish();
  });
}

// max |x| of a row of K: bfloat16's in its bits (their order is the values' where the sign is cleared), 32 at a
// time.
template <typename X>
PACKED_TARGET float max_abs(const X* row, int64_t k_len) {
  if constexpr (std::is_same_v<X, bf16>) {
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    __m512i top = _mm512_setzero_si512();
    for (int64_t k = 0; k < k_len; k += 32) {
      const __mmask32 mask = k + 32 <= k_len ? ~__mmask32(0) : (__mmask32(1) << (k_len - k)) - 1;
      top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_maskz_loadu_epi16(mask, row + k), magnitude));
    }
    const __m512i wide = _mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(top)),
                                          _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(top, 1)));
    const uint32_t bits = _mm512_reduce_max_epu32(wide) << 16;
    float max;
    std::memcpy(&max, &bits, sizeof max);
    return max;
  } else {
    __m512 top = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 16) {
      const __mmask16 mask = k + 16 <= k_len ? __mmask16(0xFFFF) : __mmask16((1u << (k_len - k)) - 1);
      top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, row + k)));
    }
    return _mm512_reduce_max_ps(top);
  }
}

// x [M, K] (bfloat16 or float32) as int8 per row, symmetric (scale = max |x| * (1 / 127), x * (127 / max |x|)
// rounded to nearest even), stored offset by 128 as uint8: q [M, K]; scales [M].
template <typename X>
PACKED_TARGET void quantize_rows(const X* x, int64_t m_len, int64_t k_len, uint8_t* q, float* scales) {
  // The dword order that puts 4 vectors of int32, packed to bytes per 128-bit lane by packs_epi32 and
  // packs_epi16, back in order: dword j of the result is 128-bit lane j % 4's of vector j / 4.
  const __m512i packed_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  at::parallel_for(0, m_len, 16, [&](int64_t begin, int64_t end) PACKED_TARGET {
    for (int64_t m = begin; m < end; ++m) {
      const X* row = x + m * k_len;
      const auto widen = [&](int64_t k, __mmask16 mask) PACKED_TARGET {
        if constexpr (std::is_same_v<X, bf16>) {  // bfloat16 is float32's top half
          const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, row + k));
          return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        } else {
          return _mm512_maskz_loadu_ps(mask, row + k);
        }
      };
      const auto mask_at = [&](int64_t k) {
        return k + 16 <= k_len ? __mmask16(0xFFFF) : __mmask16((1u << (k_len - k)) - 1);
      };
      const float max = max_abs(row, k_len);
      // Written as -ffast-math leaves them (a product by a constant's reciprocal, one division), so that a
      // reference in float32 rounds the same ties the same way.
      scales[m] = max > 0.0f ? max * (1.0f / 127.0f) : 1.0f;
      const __m512 inverse = _mm512_set1_ps(max > 0.0f ? 127.0f / max : 1.0f);
      const auto ints = [&](int64_t k, __mmask16 mask) PACKED_TARGET {  // to nearest, in [-127, 127]
        return _mm512_cvtps_epi32(_mm512_mul_ps(widen(k, mask), inverse));
      };
      int64_t k = 0;
      for (; k + 64 <= k_len; k += 64) {  // 64 bytes at a time: packed twice (per 128-bit lane), then in order
        const __m512i first = _mm512_packs_epi32(ints(k, 0xFFFF), ints(k + 16, 0xFFFF));
        const __m512i second = _mm512_packs_epi32(ints(k + 32, 0xFFFF), ints(k + 48, 0xFFFF));
        const __m512i bytes = _mm512_packs_epi16(first, second);
        const __m512i ordered = _mm512_permutexvar_epi32(packed_order, bytes);
        _mm512_storeu_si512(q + m * k_len + k, _mm512_xor_si512(ordered, _mm512_set1_epi8(-128)));  // + 128
      }
      for (; k < k_len; k += 16) {
        const __m512i offset = _mm512_add_epi32(ints(k, mask_at(k)), _mm512_set1_epi32(128));
        _mm_mask_storeu_epi8(q + m * k_len + k, mask_at(k), _mm512_cvtusepi32_epi8(offset));
      }
    }
  });
}
#endif

}  // namespace

at::Tensor packed_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> scale,
                         std::optional<at::Tensor> w_sums, std::optional<at::Tensor> bias, int64_t n_len, bool amx,
                         bool gated) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_shape;
  const bool quantized = packed.scalar_type() == at::kChar;
  pagedserve::check_cpu_float(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], not ", x.sizes());
  const int64_t m_len = x.size(0), k_len = x.size(1);
  const int64_t groups = (n_len + kGroup - 1) / kGroup;
  TORCH_CHECK_VALUE(!gated || n_len % (2 * kGroup) == 0, "a gated weight's gate and up rows must each be a multiple of ",
                    kGroup, ", not ", n_len, " rows in all");
  const int64_t step = quantized ? 4 : 2;
  TORCH_CHECK_VALUE(n_len > 0 && k_len % step == 0, "a packed ", quantized ? "int8" : "bfloat16",
                    " weight needs N > 0 and K a multiple of ", step, ", not N ", n_len, " and K ", k_len);
  // vpdpbusd's int32 sums of up to K products of 255 * 127 must not overflow.
  TORCH_CHECK_VALUE(!quantized || k_len < (int64_t{1} << 16), "an int8 x int8 product takes K below 65536, not ",
                    k_len);
  check_cpu(packed, "packed", quantized ? at::kChar : at::kBFloat16);
  TORCH_CHECK_VALUE(quantized || x.scalar_type() == at::kBFloat16, "a packed bfloat16 weight takes bfloat16 x, not ",
                    c10::getDtypeNames(x.scalar_type()).first);
  check_shape(packed, "packed", {groups, k_len / step, kGroup, step}, "[", groups, ", ", k_len / step, ", ", kGroup,
              ", ", step, "]");
  check_contiguous(packed, "packed");
  TORCH_CHECK_VALUE(scale.has_value() == quantized && w_sums.has_value() == quantized,
                    quantized ? "an int8 weight needs its scale and its sums"
                              : "a scale and sums go with an int8 weight only");
  if (scale) {
    check_cpu(*scale, "scale");
    check_shape(*scale, "scale", {n_len}, "[", n_len, "]");
    check_contiguous(*scale, "scale");
  }
  if (w_sums) {
    check_cpu(*w_sums, "w_sums", at::kInt);
    check_shape(*w_sums, "w_sums", {groups * kGroup}, "[", groups * kGroup, "]");
    check_contiguous(*w_sums, "w_sums");
  }
  if (bias) check_shape(*bias, "bias", {n_len}, "[", n_len, "]");
  const auto xc = x.contiguous();
  const auto bf = bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  auto y = at::empty({m_len, gated ? n_len / 2 : n_len}, x.options());
  // A step with no row to sample asks the vocabulary projection for none: nothing to split among threads.
  if (m_len == 0) return y;
  const int64_t items = gated ? groups / 2 : groups;  // gated, each runs gate's group and up's
#if defined(__x86_64__)
  Operands o{xc.data_ptr(), nullptr, packed.data_ptr(), nullptr, scale ? scale->data_ptr<float>() : nullptr,
             bf ? bf->data_ptr<float>() : nullptr, y.data_ptr(), k_len, n_len};
  if (quantized) {
    // The tiles take x's rows 32 at a time: those past M are read (zeros), and their sums dropped.
    const bool tiles = amx && k_len % kAmxK == 0;
    TORCH_CHECK(!tiles || amx::request_tiles(),
                "AMX's tiles were asked for, but the kernel does not grant this process them");
    const int64_t rows = tiles ? (m_len + kAmxRows - 1) / kAmxRows * kAmxRows : m_len;
    auto q = at::empty({rows, k_len}, x.options().dtype(at::kByte));
    q.narrow(0, m_len, rows - m_len).zero_();
    auto x_scale = at::empty({m_len}, x.options().dtype(at::kFloat));
    o.x = q.data_ptr<uint8_t>();
    o.x_scale = x_scale.data_ptr<float>();
    o.w_sums = w_sums->data_ptr<int32_t>();
    const auto quantize_and_run = [&](auto tag) {
      using Y = decltype(tag);
      quantize_rows(xc.data_ptr<Y>(), m_len, k_len, q.data_ptr<uint8_t>(), x_scale.data_ptr<float>());
      if (tiles) {
        run_amx<Y>(o, m_len, items, gated);
      } else {
        run<Int8Dot, Y>(o, m_len, items, gated);
      }
    };
    if (x.scalar_type() == at::kFloat) {
      quantize_and_run(float{});
    } else {
      quantize_and_run(bf16{});
    }
  } else {
    run<Bf16Dot, bf16>(o, m_len, items, gated);
  }
  return y;
#else
  TORCH_CHECK(false, "packed_linear runs on x86-64 CPUs with AVX512-VNNI (and AVX512-BF16 for bfloat16 x)");
#endif
}
