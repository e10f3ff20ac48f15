// Paged prefill attention on the CPU: each sequence's chunk of new query tokens attends causally to its
// cached prefix and to itself, reading K and V where they lie in the pool's pages, in float32 whatever the
// pool's dtype (but for the bfloat16 path below, whose products take bfloat16), in the manner of
// FlashAttention: a running max and sum a query row, so no [n, L] score matrix.
//
// q [N, Hq, D]: the chunks one after another, sequence s's rows q[query_start[s]:query_start[s + 1]], at the
// positions seq_lens[s] - n_s .. seq_lens[s] - 1. kv_layer [2, P, B, Hkv, D], block_tables [S, W], seq_lens
// [S], query_start [S + 1] (int64). window, softcap and sinks as in paged_decode.cpp.
//
// A task is one KV head of a block of kQueryBlock tokens of one sequence: its rows are those tokens' query
// heads of that KV head, which share every K and V row read. Each (sequence, KV head)'s keys are first copied
// once from their pages into the products' layouts (FloatOperands), widened to float32, for all its tasks.
// A task takes its keys kStepKeys at a time: the scores of all its rows, their softmax, then the weighted
// sum of V, each product a register block of rows by vectors, so that every K or V vector loaded serves
// several rows. The tasks go to the threads by their cost (a causal chunk's last block sees the most keys),
// longest first. On a Zen 4 this took the float32 attention of 4 prompts of 512 through SmolLM2's 30 layers
// from 528 to 340 ms (a block of 6 rows against one of 1 or 2 rows, with keys copied again for each block).
//
// Where both the queries and the pool are bfloat16 and the CPU runs AVX512-BF16, Bf16Block takes the tasks
// instead: its two products multiply bfloat16 pairs, with vdpbf16ps or on AMX's tiles where they run, on each
// (sequence, KV head)'s keys copied once into their operands' layout (below). On a Zen 4, vdpbf16ps took the
// attention of 4 prompts of 512 through SmolLM2's 30 layers from 509 to 195 ms (scripts/bench_cpu_ops.py).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "amx.h"
#include "attention_steps.h"
#include "checks.h"
#include "floats.h"

namespace {

using pagedserve::bf16, pagedserve::kLanes, pagedserve::load, pagedserve::store, pagedserve::to_float, pagedserve::Vec;
using pagedserve::attention::first_key, pagedserve::attention::kStepKeys, pagedserve::attention::round_up,
    pagedserve::attention::seen_in_step, pagedserve::attention::step_of;
#if defined(__x86_64__)
namespace amx = pagedserve::amx;
#endif

constexpr int64_t kQueryBlock = 16;  // tokens a task
constexpr int64_t kVecs = 4;         // vectors of a row's scores, or of its output's columns, a product holds
constexpr int64_t kRowsAtOnce = kLanes == 16 ? 6 : 3;  // rows a product holds: 24 (of 32) AVX-512 registers
                                                      // of sums, or 12 (of 16) AVX2 ones

struct Task {
  int64_t seq, first, count, head;  // the sequence, its first query token of the block (an index into its
                                    // chunk), how many, and the KV head
  int64_t cost;                     // keys seen, summed over the block's tokens
};

// What one sequence's tasks read: its table, its length, where its chunk starts, and the layer's variations.
struct Shape {
  int64_t page_size, kv_heads, pages, dim, group, q_heads;
  float scale, softcap;
  int64_t window;
};

// The key positions [base, base + keys) that one (sequence, KV head)'s copied operands hold: whole steps,
// from the one that holds lo to len.
struct KeySpan {
  int64_t base = 0, keys = 0;
  void cover(int64_t lo, int64_t len) {
    base = step_of(lo);
    keys = round_up(len - base, kStepKeys);
  }
};

// The K and V rows of KV head h that one (sequence, KV head)'s tasks read, found in the pages of its table:
// k[j] and v[j] for the sequence position span.base + j, j in [0, span.keys); a row of zeros for a position
// outside [lo, len). The operands' copies take them a block of kCopyKeys keys at a time, [first_block, end),
// so that each dim's (or pair's) stores into K's transposed layout are consecutive. A key's stores there, a
// power of two apart, took the op 3-6% longer on a Zen 4 (both builds timed in one process); on the AMX
// Xeon those copies, with Q's and the tasks' setup, were about 0.8 of 3.5-4.5 ms a layer.
constexpr int64_t kCopyKeys = 16;

template <typename T>
struct KeyRows {
  std::vector<T> zeros;
  std::vector<const T*> k, v;
  int64_t first_block, end;

  KeyRows(const T* k_data, const T* v_data, const int64_t* table, const Shape& s, const KeySpan& span, int64_t lo,
          int64_t len, int64_t h)
      : zeros(s.dim, T(0.0f)),
        k(span.keys, zeros.data()),
        v(span.keys, zeros.data()),
        first_block((lo - span.base) / kCopyKeys * kCopyKeys),
        end(len - span.base) {
    const int64_t row_stride = s.kv_heads * s.dim;
    for (int64_t pos = lo; pos < len; ++pos) {
      const int64_t page = table[pos / s.page_size];
      TORCH_CHECK(page >= 0 && page < s.pages, "block_tables holds page ", page, ", outside the pool");
      const int64_t at = (page * s.page_size + pos % s.page_size) * row_stride + h * s.dim;
      k[pos - span.base] = k_data + at;
      v[pos - span.base] = v_data + at;
    }
  }
};

// One (sequence, KV head)'s keys, widened to float32 once for all its tasks, in the products' layouts: K
// transposed, [D, keys], so that a row's scores against consecutive keys are vectors of FMAs with no
// horizontal sums; V as [keys, columns], its rows D rounded up to whole vectors. Every key outside [first key
// seen, length) and every column past D is zero, so a slot never read stays unread. They live for one call:
// one layer's K and V of the sequences prefilled, in float32, a fraction of what the pool holds for them.
struct FloatOperands : KeySpan {
  std::vector<float> k, v;
  int64_t columns = 0;
};

template <typename T>
void gather_float_operands(const T* k_data, const T* v_data, const int64_t* table, const Shape& s, int64_t lo,
                           int64_t len, int64_t h, FloatOperands& o) {
  const int64_t dim = s.dim;
  o.cover(lo, len);
  o.columns = round_up(dim, kLanes);
  o.k.assign(dim * o.keys, 0.0f);
  o.v.assign(o.keys * o.columns, 0.0f);
  const KeyRows<T> rows(k_data, v_data, table, s, o, lo, len, h);
  for (int64_t j0 = rows.first_block; j0 < rows.end; j0 += kCopyKeys) {
    for (int64_t d = 0; d < dim; ++d) {
      float* to = o.k.data() + d * o.keys + j0;
      for (int64_t i = 0; i < kCopyKeys; ++i) to[i] = to_float(rows.k[j0 + i][d]);
    }
    for (int64_t j = j0; j < j0 + kCopyKeys; ++j) {
      for (int64_t d = 0; d < dim; ++d) o.v[j * o.columns + d] = to_float(rows.v[j][d]);
    }
  }
}

// A task in float32: S = Q K^T a step of kStepKeys keys at a time, the softmax of each row's scores (a running
// max and sum), then acc = acc * rescale + P V, each product kRowsAtOnce rows by kVecs vectors of sums held in
// registers, so that every K or V vector loaded serves several rows.
class Block {
 public:
  explicit Block(const Shape& shape) : s_(shape) {}

  // One task: rows r = token * group + g, queries at q (float32, [count * group, D] with a stride of Hq * D
  // between tokens), its keys from o, out likewise.
  void run(const float* q, const FloatOperands& o, int64_t cached, const Task& task, const float* sinks,
           float* out) {
    const int64_t group = s_.group, rows = task.count * group, dim = s_.dim, token_stride = s_.q_heads * dim;
    const int64_t padded = round_up(rows, kRowsAtOnce);
    q_.assign(padded * dim, 0.0f);  // rows past `rows` stay zero, and their weights too
    acc_.assign(padded * o.columns, 0.0f);
    probs_.assign(padded * kStepKeys, 0.0f);
    rescale_.assign(padded, 1.0f);
    top_.resize(rows);
    sum_.resize(rows);
    for (int64_t i = 0; i < task.count; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        const float* from = q + i * token_stride + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) q_[r * dim + d] = from[d] * s_.scale;
        // A sink is a key of logit sinks[h] whose value is zero: the softmax starts from it.
        top_[r] = sinks ? sinks[g] : -1e30f;
        sum_[r] = sinks ? 1.0f : 0.0f;
      }
    }
    const int64_t first_pos = cached + task.first, last_pos = first_pos + task.count - 1;
    for (int64_t k0 = step_of(first_key(first_pos, s_.window)); k0 <= last_pos; k0 += kStepKeys) {
      const int64_t keys = std::min(kStepKeys, last_pos + 1 - k0);  // those any row of the task sees
      score(o, k0 - o.base, keys, padded);
      for (int64_t r = 0; r < rows; ++r) {
        const auto [lo, hi] = seen_in_step(first_pos + r / group, k0, keys, s_.window);  // r's token's keys
        softmax(r, lo, hi, keys);
      }
      accumulate(o, k0 - o.base, keys, padded);
    }
    for (int64_t i = 0; i < task.count; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        const float inv = 1.0f / sum_[r];
        float* to = out + i * token_stride + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) to[d] = acc_[r * o.columns + d] * inv;
      }
    }
  }

 private:
  // probs_ = the scaled scores of every row against the `keys` keys at o's index j0 on, kVecs vectors of keys
  // at a time (fewer for the step's last keys). A step's keys lie inside o's, so a vector past `keys` reads
  // zeros or keys no row sees.
  void score(const FloatOperands& o, int64_t j0, int64_t keys, int64_t padded) {
    for (int64_t r0 = 0; r0 < padded; r0 += kRowsAtOnce) {
      for (int64_t c = 0; c < keys; c += kVecs * kLanes) {
        switch (std::min<int64_t>(kVecs, (keys - c + kLanes - 1) / kLanes)) {
          case 4: score<4>(o, j0 + c, r0, c); break;
          case 3: score<3>(o, j0 + c, r0, c); break;
          case 2: score<2>(o, j0 + c, r0, c); break;
          default: score<1>(o, j0 + c, r0, c);
        }
      }
    }
  }

  template <int kKeyVecs>
  void score(const FloatOperands& o, int64_t j, int64_t r0, int64_t c) {
    Vec sums[kRowsAtOnce][kKeyVecs] = {};
    for (int64_t d = 0; d < s_.dim; ++d) {
      const float* k = o.k.data() + d * o.keys + j;
      Vec key[kKeyVecs];
      for (int v = 0; v < kKeyVecs; ++v) key[v] = load(k + v * kLanes);
      for (int64_t i = 0; i < kRowsAtOnce; ++i) {
        const float query = q_[(r0 + i) * s_.dim + d];
        for (int v = 0; v < kKeyVecs; ++v) sums[i][v] += query * key[v];
      }
    }
    for (int64_t i = 0; i < kRowsAtOnce; ++i) {
      for (int v = 0; v < kKeyVecs; ++v) store(probs_.data() + (r0 + i) * kStepKeys + c + v * kLanes, sums[i][v]);
    }
  }

  // Row r's running max and sum after its scores against the step's keys [lo, hi), and its weights
  // (attention_steps.h, which the decode's rows take too).
  void softmax(int64_t r, int64_t lo, int64_t hi, int64_t keys) {
    pagedserve::attention::float_softmax_step(probs_.data() + r * kStepKeys, lo, hi, keys, s_.softcap, top_[r],
                                              sum_[r], rescale_[r]);
  }

  // acc_ = acc_ * rescale_ + probs_ V for the `keys` keys at o's index j0 on, kVecs vectors of columns at a
  // time (fewer for a head's last columns).
  void accumulate(const FloatOperands& o, int64_t j0, int64_t keys, int64_t padded) {
    for (int64_t r0 = 0; r0 < padded; r0 += kRowsAtOnce) {
      for (int64_t d0 = 0; d0 < o.columns; d0 += kVecs * kLanes) {
        switch (std::min<int64_t>(kVecs, (o.columns - d0) / kLanes)) {
          case 4: accumulate<4>(o, j0, keys, r0, d0); break;
          case 3: accumulate<3>(o, j0, keys, r0, d0); break;
          case 2: accumulate<2>(o, j0, keys, r0, d0); break;
          default: accumulate<1>(o, j0, keys, r0, d0);
        }
      }
    }
  }

  template <int kColumnVecs>
  void accumulate(const FloatOperands& o, int64_t j0, int64_t keys, int64_t r0, int64_t d0) {
    Vec sums[kRowsAtOnce][kColumnVecs];
    for (int64_t i = 0; i < kRowsAtOnce; ++i) {
      const float* acc = acc_.data() + (r0 + i) * o.columns + d0;
      for (int v = 0; v < kColumnVecs; ++v) sums[i][v] = load(acc + v * kLanes) * rescale_[r0 + i];
    }
    for (int64_t j = 0; j < keys; ++j) {
      const float* value = o.v.data() + (j0 + j) * o.columns + d0;
      Vec column[kColumnVecs];
      for (int v = 0; v < kColumnVecs; ++v) column[v] = load(value + v * kLanes);
      for (int64_t i = 0; i < kRowsAtOnce; ++i) {
        const float weight = probs_[(r0 + i) * kStepKeys + j];
        for (int v = 0; v < kColumnVecs; ++v) sums[i][v] += weight * column[v];
      }
    }
    for (int64_t i = 0; i < kRowsAtOnce; ++i) {
      float* acc = acc_.data() + (r0 + i) * o.columns + d0;
      for (int v = 0; v < kColumnVecs; ++v) store(acc + v * kLanes, sums[i][v]);
    }
  }

  const Shape s_;
  std::vector<float> q_, acc_, probs_, rescale_, top_, sum_;
};

#if defined(__x86_64__)
// Where the queries and the pool are both bfloat16 and the CPU multiplies bfloat16 pairs (AVX512-BF16, and
// AMX's tiles where they run), Bf16Block takes the tasks: its two products, S = Q K^T and acc += P V, are
// float32 sums of bfloat16 products, on the tiles or with vdpbf16ps. Q, K and V are bfloat16 already, so only
// P would round: it is split into the bfloat16 it truncates to and the bfloat16 of what that leaves (P = hi +
// lo to 2^-16 of it), and both halves are multiplied, so that the output is what the float32 path computes,
// to about float32's rounding. (With P rounded once, as FlashAttention does on a GPU, a build's last bits
// moved SmolLM2's first token at a near-tie of its chat prompt, 'The' -1.88 against 'L' -1.97 in float32.)
//
// Both products take their right operand with pairs of consecutive k side by side, so each (sequence, KV
// head)'s keys are first copied once into that form (Operands): K as [D / 2, keys, 2] (pairs of dims) and V
// as [keys / 2, D, 2] (pairs of keys), every key outside [first key seen, length) zero, so that a slot never
// read stays unread. The softmax runs on AVX-512 between the products, up to kStepKeys keys a row at a time
// (four of P's tiles of 32 columns).
constexpr int64_t kVectorRows = 4;  // rows the vdpbf16ps products take at a time: 16 registers of sums
struct Operands : KeySpan {
  std::vector<uint16_t> k, v;  // bfloat16 bits: [D / 2, keys, 2] and [keys / 2, D, 2]
};

// Sequence positions [lo, len) of KV head h into o; the rest of o's keys zero.
void gather_operands(const bf16* k_data, const bf16* v_data, const int64_t* table, const Shape& s, int64_t lo,
                     int64_t len, int64_t h, Operands& o) {
  const int64_t dim = s.dim;
  o.cover(lo, len);
  o.k.assign(dim * o.keys, 0);
  o.v.assign(o.keys * dim, 0);
  const KeyRows<bf16> rows(k_data, v_data, table, s, o, lo, len, h);
  for (int64_t j0 = rows.first_block; j0 < rows.end; j0 += kCopyKeys) {
    for (int64_t p = 0; p < dim / 2; ++p) {  // K's pair of dims p, 32 bits a key
      uint32_t* to = reinterpret_cast<uint32_t*>(o.k.data()) + p * o.keys + j0;
      for (int64_t i = 0; i < kCopyKeys; ++i) std::memcpy(to + i, rows.k[j0 + i] + 2 * p, sizeof *to);
    }
    for (int64_t j = j0; j < j0 + kCopyKeys; j += 2) {  // V's pairs of keys, interleaved
      uint16_t* to = o.v.data() + j / 2 * dim * 2;
      for (int64_t d = 0; d < dim; ++d) {
        to[2 * d] = rows.v[j][d].x;
        to[2 * d + 1] = rows.v[j + 1][d].x;
      }
    }
  }
}

class Bf16Block {
 public:
  // tiles: the products run on AMX's tiles, of which the thread has configured 8 (amx::Tiles); else on vdpbf16ps.
  Bf16Block(const Shape& shape, bool tiles) : s_(shape), tiles_(tiles) {}

  // One task, as Block::run, its keys from o.
  DOT_BF16_TARGET void run(const bf16* q, const Operands& o, int64_t cached, const Task& task, const float* sinks,
                       bf16* out) {
    const int64_t group = s_.group, rows = task.count * group, dim = s_.dim;
    const int64_t rows_at_once = tiles_ ? amx::kRows : kVectorRows, token_stride = s_.q_heads * dim;
    const int64_t padded = (rows + rows_at_once - 1) / rows_at_once * rows_at_once;
    q_.assign(padded * dim, 0);
    acc_.assign(padded * dim, 0.0f);
    probs_.assign(2 * padded * kStepKeys, 0);  // P's high halves, then its low ones; rows past `rows` stay zero
    scores_.resize(padded * kStepKeys);
    top_.resize(rows);
    sum_.resize(rows);
    for (int64_t i = 0; i < task.count; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        std::memcpy(q_.data() + r * dim, q + i * token_stride + g * dim, dim * sizeof(bf16));
        top_[r] = sinks ? sinks[g] : -1e30f;
        sum_[r] = sinks ? 1.0f : 0.0f;
      }
    }
    const int64_t first_pos = cached + task.first, last_pos = first_pos + task.count - 1;
    for (int64_t k0 = step_of(first_key(first_pos, s_.window)); k0 <= last_pos; k0 += kStepKeys) {
      const int64_t keys = std::min(kStepKeys, last_pos + 1 - k0);  // those any row of the task sees
      if (tiles_) {
        score_tiles(o, k0 - o.base, keys, padded);
      } else {
        score_vectors(o, k0 - o.base, keys, padded);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const auto [lo, hi] = seen_in_step(first_pos + r / group, k0, keys, s_.window);
        update(r, lo, hi);
      }
      if (tiles_) {
        accumulate_tiles(o, k0 - o.base, keys, padded);
      } else {
        accumulate_vectors(o, k0 - o.base, keys, padded);
      }
    }
    for (int64_t i = 0; i < task.count; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        const float inv = 1.0f / sum_[r];
        bf16* to = out + i * token_stride + g * dim;
        for (int64_t d = 0; d < dim; ++d) to[d] = pagedserve::from_float<bf16>(acc_[r * dim + d] * inv);
      }
    }
  }

 private:
  // scores_ = Q K^T for the `keys` keys at o's index j0 on: 64 keys at a time in tiles 0-3 (a chain of sums
  // each, so that one product need not wait on the last), Q in tile 4, K in 5 and 6.
  AMX_TARGET void score_tiles(const Operands& o, int64_t j0, int64_t keys, int64_t padded) {
    const int64_t dim = s_.dim;
    for (int64_t r0 = 0; r0 < padded; r0 += amx::kRows) {
      for (int64_t c = 0; c < keys; c += 64) {
        const int64_t chunks = std::min<int64_t>(4, (keys - c + 15) / 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d0 = 0; d0 < dim; d0 += 32) {
          _tile_loadd(4, q_.data() + r0 * dim + d0, dim * 2);
          const uint16_t* k = o.k.data() + ((d0 / 2) * o.keys + j0 + c) * 2;
          _tile_loadd(5, k, o.keys * 4);
          _tile_dpbf16ps(0, 4, 5);
          if (chunks > 1) {
            _tile_loadd(6, k + 32, o.keys * 4);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (chunks > 2) {
            _tile_loadd(5, k + 64, o.keys * 4);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (chunks > 3) {
            _tile_loadd(6, k + 96, o.keys * 4);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        float* to = scores_.data() + r0 * kStepKeys + c;
        _tile_stored(0, to, kStepKeys * 4);
        if (chunks > 1) _tile_stored(1, to + 16, kStepKeys * 4);
        if (chunks > 2) _tile_stored(2, to + 32, kStepKeys * 4);
        if (chunks > 3) _tile_stored(3, to + 48, kStepKeys * 4);
      }
    }
  }

  // score_tiles() with vdpbf16ps: kVectorRows rows and 64 keys at a time, each vector of K's pairs loaded once
  // for the rows. A step's 128 keys lie inside o's, so a vector past `keys` reads zeros or keys no row sees.
  DOT_BF16_TARGET void score_vectors(const Operands& o, int64_t j0, int64_t keys, int64_t padded) {
    const int64_t dim = s_.dim;
    for (int64_t r0 = 0; r0 < padded; r0 += kVectorRows) {
      for (int64_t c = 0; c < keys; c += 64) {
        __m512 sums[kVectorRows][4];
        for (auto& row : sums) {
          for (__m512& sum : row) sum = _mm512_setzero_ps();
        }
        for (int64_t pair = 0; pair < dim / 2; ++pair) {
          const uint16_t* k = o.k.data() + (pair * o.keys + j0 + c) * 2;
          __m512bh key[4];
          for (int v = 0; v < 4; ++v) key[v] = (__m512bh)_mm512_loadu_si512(k + 32 * v);
          for (int64_t i = 0; i < kVectorRows; ++i) {
            const __m512bh query = pagedserve::attention::broadcast_pair(q_.data() + (r0 + i) * dim + 2 * pair);
            for (int v = 0; v < 4; ++v) sums[i][v] = _mm512_dpbf16_ps(sums[i][v], query, key[v]);
          }
        }
        for (int64_t i = 0; i < kVectorRows; ++i) {
          for (int v = 0; v < 4; ++v) _mm512_storeu_ps(scores_.data() + (r0 + i) * kStepKeys + c + 16 * v, sums[i][v]);
        }
      }
    }
  }

  // Row r's running max, sum and output rescaled after its scores against the step's keys [lo, hi), and its
  // weights in probs_ as their two halves (attention_steps.h, which the decode's rows take too).
  DOT_BF16_TARGET void update(int64_t r, int64_t lo, int64_t hi) {
    uint16_t* high = probs_.data() + r * kStepKeys;
    pagedserve::attention::softmax_step(scores_.data() + r * kStepKeys, high, high + probs_.size() / 2, lo, hi,
                                        s_.scale, s_.softcap, top_[r], sum_[r], acc_.data() + r * s_.dim, s_.dim);
  }

  // acc_ += probs_ V for the `keys` keys at o's index j0 on (32 a step): 64 columns of the sums at a time in
  // tiles 0-3, P's high half in tile 4 and its low half in 7, V in 5 and 6.
  AMX_TARGET void accumulate_tiles(const Operands& o, int64_t j0, int64_t keys, int64_t padded) {
    const int64_t dim = s_.dim;
    for (int64_t r0 = 0; r0 < padded; r0 += amx::kRows) {
      for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int64_t blocks = std::min<int64_t>(4, (dim - d0) / 16);
        float* acc = acc_.data() + r0 * dim + d0;
        _tile_loadd(0, acc, dim * 4);
        _tile_loadd(1, acc + 16, dim * 4);
        if (blocks > 2) {
          _tile_loadd(2, acc + 32, dim * 4);
          _tile_loadd(3, acc + 48, dim * 4);
        }
        for (int64_t c = 0; c < keys; c += 32) {
          _tile_loadd(4, probs_.data() + r0 * kStepKeys + c, kStepKeys * 2);
          _tile_loadd(7, probs_.data() + probs_.size() / 2 + r0 * kStepKeys + c, kStepKeys * 2);
          const uint16_t* v = o.v.data() + ((j0 + c) / 2 * dim + d0) * 2;
          _tile_loadd(5, v, dim * 4);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(0, 7, 5);
          _tile_loadd(6, v + 32, dim * 4);
          _tile_dpbf16ps(1, 4, 6);
          _tile_dpbf16ps(1, 7, 6);
          if (blocks > 2) {
            _tile_loadd(5, v + 64, dim * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(2, 7, 5);
            _tile_loadd(6, v + 96, dim * 4);
            _tile_dpbf16ps(3, 4, 6);
            _tile_dpbf16ps(3, 7, 6);
          }
        }
        _tile_stored(0, acc, dim * 4);
        _tile_stored(1, acc + 16, dim * 4);
        if (blocks > 2) {
          _tile_stored(2, acc + 32, dim * 4);
          _tile_stored(3, acc + 48, dim * 4);
        }
      }
    }
  }

  // accumulate_tiles() with vdpbf16ps: kVectorRows rows and 64 columns (2 or 4 vectors of 16) at a time, a
  // pair of keys a step. Keys past `keys` weigh zero in probs_.
  DOT_BF16_TARGET void accumulate_vectors(const Operands& o, int64_t j0, int64_t keys, int64_t padded) {
    for (int64_t r0 = 0; r0 < padded; r0 += kVectorRows) {
      for (int64_t d0 = 0; d0 < s_.dim; d0 += 64) {
        if (s_.dim - d0 >= 64) {
          accumulate_vectors<4>(o, j0, keys, r0, d0);
        } else {
          accumulate_vectors<2>(o, j0, keys, r0, d0);  // a head of 32, 96, ...: its last 32 columns
        }
      }
    }
  }

  template <int kVecs>
  DOT_BF16_TARGET void accumulate_vectors(const Operands& o, int64_t j0, int64_t keys, int64_t r0, int64_t d0) {
    const int64_t dim = s_.dim;
    const uint16_t* high = probs_.data() + r0 * kStepKeys;
    const uint16_t* low = high + probs_.size() / 2;
    __m512 sums[kVectorRows][kVecs];
    for (int64_t i = 0; i < kVectorRows; ++i) {
      for (int v = 0; v < kVecs; ++v) sums[i][v] = _mm512_loadu_ps(acc_.data() + (r0 + i) * dim + d0 + 16 * v);
    }
    for (int64_t j = 0; j < keys; j += 2) {
      const uint16_t* pairs = o.v.data() + ((j0 + j) / 2 * dim + d0) * 2;
      __m512bh value[kVecs];
      for (int v = 0; v < kVecs; ++v) value[v] = (__m512bh)_mm512_loadu_si512(pairs + 32 * v);
      for (int64_t i = 0; i < kVectorRows; ++i) {
        for (int v = 0; v < kVecs; ++v) {
          sums[i][v] = pagedserve::attention::add_pair(sums[i][v], high + i * kStepKeys + j, low + i * kStepKeys + j,
                                                       value[v]);
        }
      }
    }
    for (int64_t i = 0; i < kVectorRows; ++i) {
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(acc_.data() + (r0 + i) * dim + d0 + 16 * v, sums[i][v]);
    }
  }

  const Shape s_;
  const bool tiles_;
  std::vector<uint16_t> q_, probs_;
  std::vector<float> acc_, scores_, top_, sum_;
};

// Whether Bf16Block takes this layer: bfloat16 queries over a bfloat16 pool, heads a whole number of Q's
// 32-column tiles (of vdpbf16ps's 32-value vectors).
bool bf16_takes(const at::Tensor& q, const at::Tensor& kv_layer, int64_t dim) {
  return q.scalar_type() == at::kBFloat16 && kv_layer.scalar_type() == at::kBFloat16 && dim % 32 == 0;
}
#endif

void check(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& lens,
           const at::Tensor& starts, const std::optional<at::Tensor>& sinks) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_shape, pagedserve::kAny;
  pagedserve::check_attention(q, "N", kv, sinks);
  check_cpu(tables, "block_tables", at::kLong);
  check_shape(tables, "block_tables", {kAny, kAny}, "[S, W]");
  check_contiguous(tables, "block_tables");
  const int64_t seqs = tables.size(0);
  check_cpu(lens, "seq_lens", at::kLong);
  check_shape(lens, "seq_lens", {seqs}, "[", seqs, "]");
  check_contiguous(lens, "seq_lens");
  check_cpu(starts, "query_start", at::kLong);
  check_shape(starts, "query_start", {seqs + 1}, "[", seqs + 1, "]");
  check_contiguous(starts, "query_start");
}

}  // namespace

at::Tensor paged_prefill(at::Tensor q, at::Tensor kv_layer, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor query_start, double scale, int64_t window, double softcap,
                         std::optional<at::Tensor> sinks, bool dot_bf16, bool amx) {
  check(q, kv_layer, block_tables, seq_lens, query_start, sinks);
  const int64_t seqs = block_tables.size(0), width = block_tables.size(1);
  const Shape shape{kv_layer.size(2), kv_layer.size(3), kv_layer.size(1), q.size(2), q.size(1) / kv_layer.size(3),
                    q.size(1), static_cast<float>(scale), static_cast<float>(softcap), window};
  const int64_t* len_of = seq_lens.data_ptr<int64_t>();
  const int64_t* start_of = query_start.data_ptr<int64_t>();
  TORCH_CHECK(start_of[0] == 0 && start_of[seqs] == q.size(0), "query_start must run from 0 to ", q.size(0));
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = start_of[s + 1] - start_of[s];
    TORCH_CHECK(n >= 0 && n <= len_of[s] && len_of[s] <= width * shape.page_size, "sequence ", s, "'s ", n,
                " new tokens do not fit its length ", len_of[s], " and table");
    for (int64_t first = 0; first < n; first += kQueryBlock) {
      const int64_t count = std::min(kQueryBlock, n - first), last = len_of[s] - n + first + count - 1;
      const int64_t seen = last + 1 - first_key(last - count + 1, window);
      for (int64_t h = 0; h < shape.kv_heads; ++h) tasks.push_back({s, first, count, h, seen * count});
    }
  }
  // Longest first, each to the thread with the least work so far.
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<std::vector<Task>> share(threads);
  std::vector<int64_t> load_of(threads, 0);
  for (const Task& task : tasks) {
    const auto least = std::min_element(load_of.begin(), load_of.end()) - load_of.begin();
    share[least].push_back(task);
    load_of[least] += task.cost;
  }
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const float* sink_data = sinks ? sinks->data_ptr<float>() : nullptr;
  const auto offset_of = [&](const Task& task) {
    return ((start_of[task.seq] + task.first) * shape.q_heads + task.head * shape.group) * shape.dim;
  };
  // Each (sequence, KV head)'s keys copied by gather(sequence, first key seen, KV head, its operands), on all
  // threads: operands[sequence * KV heads + KV head].
  const auto gather_all = [&](auto& operands, auto&& gather) {
    operands.resize(seqs * shape.kv_heads);
    at::parallel_for(0, seqs * shape.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t seq = i / shape.kv_heads, n = start_of[seq + 1] - start_of[seq];
        if (n > 0) gather(seq, first_key(len_of[seq] - n, window), i % shape.kv_heads, operands[i]);
      }
    });
  };
  // A thread's share of the tasks, on block, each with its (sequence, KV head)'s operands.
  const auto run_share = [&](int64_t thread, auto& block, const auto& operands, const auto* q_data, auto* out_data) {
    for (const Task& task : share[thread]) {
      const int64_t n = start_of[task.seq + 1] - start_of[task.seq];
      block.run(q_data + offset_of(task), operands[task.seq * shape.kv_heads + task.head], len_of[task.seq] - n,
                task, sink_data ? sink_data + task.head * shape.group : nullptr, out_data + offset_of(task));
    }
  };
#if defined(__x86_64__)
  if (dot_bf16 && bf16_takes(q, kv_layer, shape.dim)) {  // the output is bfloat16 as q is
    TORCH_CHECK(!amx || amx::request_tiles(),
                "AMX's tiles were asked for, but the kernel does not grant this process them");
    auto out = at::empty_like(q);
    const bf16* k_data = kv_layer.data_ptr<bf16>();
    const bf16* v_data = k_data + shape.pages * shape.page_size * shape.kv_heads * shape.dim;
    std::vector<Operands> operands;
    gather_all(operands, [&](int64_t seq, int64_t lo, int64_t h, Operands& o) {
      gather_operands(k_data, v_data, tables + seq * width, shape, lo, len_of[seq], h, o);
    });
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      std::optional<amx::Tiles> tiles;
      if (amx) tiles.emplace(8);
      Bf16Block block(shape, amx);
      for (int64_t thread = begin; thread < end; ++thread) {
        run_share(thread, block, operands, q.data_ptr<bf16>(), out.data_ptr<bf16>());
      }
    });
    return out;
  }
#endif
  const auto qf = q.to(at::kFloat).contiguous();
  auto out = at::empty_like(qf);
  std::vector<FloatOperands> operands;
  pagedserve::with_float_type(kv_layer, "kv_layer", [&](auto tag) {
    using T = decltype(tag);
    const T* k_data = kv_layer.data_ptr<T>();
    const T* v_data = k_data + shape.pages * shape.page_size * shape.kv_heads * shape.dim;
    gather_all(operands, [&](int64_t seq, int64_t lo, int64_t h, FloatOperands& o) {
      gather_float_operands(k_data, v_data, tables + seq * width, shape, lo, len_of[seq], h, o);
    });
  });
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Block block(shape);
    for (int64_t thread = begin; thread < end; ++thread) {
      run_share(thread, block, operands, qf.data_ptr<float>(), out.data_ptr<float>());
    }
  });
  return out.to(q.scalar_type());
}
