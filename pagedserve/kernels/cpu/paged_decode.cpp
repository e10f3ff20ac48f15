// Paged decode attention on the CPU: one query token a sequence, reading K and V where they lie in the
// pool's pages, with no gather into a copy of the context and no read past a sequence's length (so a page
// slot that holds no valid data never reaches the softmax, whatever it holds).
//
// q [S, Hq, D], kv_layer [2, P, B, Hkv, D], block_tables [S, W] (int64), seq_lens [S] (int64); q and the pool
// each float32 or bfloat16 (a pool may be narrower than its model), computed in float32.
// Each KV head's G = Hq / Hkv query heads share each K and V row read for them. window > 0: each query reads
// only the last `window` tokens, its own included (a sliding-window layer; the pages before may be gone).
// softcap > 0: scores become softcap * tanh(scores / softcap). sinks [Hq]: a logit per query head that joins
// the softmax's denominator and brings no value.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention_steps.h"
#include "checks.h"
#include "floats.h"

namespace {

using pagedserve::bf16;

void check(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& lens,
           const std::optional<at::Tensor>& sinks) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_shape, pagedserve::kAny;
  pagedserve::check_attention(q, "S", kv, sinks);
  const int64_t seqs = q.size(0);
  check_cpu(tables, "block_tables", at::kLong);
  check_shape(tables, "block_tables", {seqs, kAny}, "[", seqs, ", W]");
  check_contiguous(tables, "block_tables");
  check_cpu(lens, "seq_lens", at::kLong);
  check_shape(lens, "seq_lens", {seqs}, "[", seqs, "]");
}

// The softcapped, scaled score of one query and key row.
inline float score_of(float dot, float factor, float softcap) {
  const float score = dot * factor;
  return softcap > 0.0f ? softcap * std::tanh(score / softcap) : score;
}


constexpr int64_t kPrefetchPages = 2;  // how far ahead of the page being read the next pages are asked for
constexpr int64_t kRunRows = 4;        // the rows of a run

// `bytes` from `from` on asked for, into L2 (prefetcht2). Always inlined: GCC 12 finds a function that only
// prefetches free of side effects, and drops every call to it.
__attribute__((always_inline)) inline void prefetch_bytes(const void* from, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(from) + b, 0, 1);
}

// The rows a run asks for ahead of it: the same rows of the page kPrefetchPages ahead, count of them (fewer
// past the sequence's end, none where that page is not the pool's), one after another in their page.
template <typename T>
struct Ahead {
  const T* rows = nullptr;
  int64_t count = 0, row_stride = 0;

  __attribute__((always_inline)) void prefetch() const {
    prefetch_bytes(rows, count * row_stride * static_cast<int64_t>(sizeof(T)));
  }
};

// The tokens [lo, len) of a sequence as runs of up to kRunRows that lie in one page each: body(token, count,
// the run's first row). The hardware's prefetchers do not follow a block table, and without help a thread
// spent most of its time waiting for each page (scripts/bench_cpu_ops.py times the op): so before each run
// the same rows of the page kPrefetchPages ahead are asked for (Ahead). A page's rows all at once, before its
// first run, filled the core's miss buffers: `perf annotate` put a third of the scores' samples and nearly
// all of the values' page walk on the instruction after the prefetches. Into L1 (prefetcht0), or one page
// ahead, was slower.
template <typename T, typename Body>
void for_each_run(const int64_t* table, int64_t lo, int64_t len, int64_t page_size, int64_t pages,
                  int64_t row_stride, const T* data, Body&& body) {
  for (int64_t first = lo; first < len;) {
    const int64_t page = table[first / page_size], offset = first % page_size;
    TORCH_CHECK(page >= 0 && page < pages, "block_tables holds page ", page, ", outside the pool");
    const int64_t count = std::min({page_size - offset, len - first, kRunRows});
    if (const int64_t slot = first + kPrefetchPages * page_size; slot < len) {  // the same slot, pages ahead
      const int64_t later = table[slot / page_size];
      if (later >= 0 && later < pages) {  // else its own run refuses it
        Ahead<T>{data + (later * page_size + offset) * row_stride, std::min(count, len - slot), row_stride}
            .prefetch();
      }
    }
    body(first, count, data + (page * page_size + offset) * row_stride);
    first += count;
  }
}

// What a task reads and writes: a sequence's KV heads [h0, h1), each with `group` query heads; its tokens
// [lo, len); scores [rows, len - lo], one row a query head.
template <typename T>
struct Task {
  const int64_t* table;
  int64_t lo, len, h0, h1, group, page_size, kv_heads, pages, dim;
  const T* k_data;
  const T* v_data;
  int64_t row_stride() const { return kv_heads * dim; }  // elements between consecutive tokens of a page
  int64_t rows() const { return (h1 - h0) * group; }
  int64_t span() const { return len - lo; }

  // Key position j's row of KV head h in data (K's or V's), or null where the token does not see it.
  const T* row(const T* data, int64_t j, int64_t h) const {
    if (j < lo || j >= len) return nullptr;
    const int64_t page = table[j / page_size];
    TORCH_CHECK(page >= 0 && page < pages, "block_tables holds page ", page, ", outside the pool");
    return data + (page * page_size + j % page_size) * row_stride() + h * dim;
  }

  // The rows of keys [first, first + n) (row() of each), with one look at the table where they lie in one
  // page and are all seen.
  void rows_at(const T* data, int64_t first, int64_t h, int64_t n, const T** out) const {
    if (first >= lo && first + n <= len && first / page_size == (first + n - 1) / page_size) {
      const T* base = row(data, first, h);
      for (int64_t i = 0; i < n; ++i) out[i] = base + i * row_stride();
      return;
    }
    for (int64_t i = 0; i < n; ++i) out[i] = row(data, first + i, h);
  }
};

// Each query head's softcapped, scaled score of each key: a dot product and a sum of its lanes a key. With
// the head size known, each key row is widened once for all of its KV head's query heads (a bfloat16 pool
// under a float32 model widens each row once, not once a query head).
template <int64_t kDim, typename T>
void scores_of(const Task<T>& t, const float* q, float factor, float softcap, float* scores) {
  const int64_t dim = kDim > 0 ? kDim : t.dim, span = t.span();
  if constexpr (kDim > 0 && kDim % pagedserve::kLanes == 0) {
    using pagedserve::kLanes, pagedserve::Vec;
    constexpr int64_t kVecs = kDim / kLanes;
    for_each_run(t.table, t.lo, t.len, t.page_size, t.pages, t.row_stride(), t.k_data,
                 [&](int64_t first, int64_t count, const T* base) {
                   for (int64_t h = t.h0; h < t.h1; ++h) {
                     const int64_t r0 = (h - t.h0) * t.group;
                     for (int64_t i = 0; i < count; ++i) {
                       const T* key = base + i * t.row_stride() + h * kDim;
                       Vec k[kVecs];
                       for (int64_t c = 0; c < kVecs; ++c) k[c] = pagedserve::load(key + c * kLanes);
                       for (int64_t r = r0; r < r0 + t.group; ++r) {
                         const float* query = q + r * kDim;
                         Vec dot = pagedserve::load(query) * k[0];
                         for (int64_t c = 1; c < kVecs; ++c) dot += pagedserve::load(query + c * kLanes) * k[c];
                         scores[r * span + (first - t.lo) + i] = score_of(pagedserve::sum_lanes(dot), factor, softcap);
                       }
                     }
                   }
                 });
    return;
  }
  for_each_run(t.table, t.lo, t.len, t.page_size, t.pages, t.row_stride(), t.k_data,
               [&](int64_t first, int64_t count, const T* base) {
                 for (int64_t h = t.h0; h < t.h1; ++h) {
                   for (int64_t g = 0; g < t.group; ++g) {
                     const int64_t r = (h - t.h0) * t.group + g;
                     const float* query = q + r * dim;
                     float* row = scores + r * span + (first - t.lo);
                     for (int64_t i = 0; i < count; ++i) {
                       const T* key = base + i * t.row_stride() + h * dim;
                       float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                       for (int64_t d = 0; d < dim; ++d) dot += query[d] * pagedserve::to_float(key[d]);
                       row[i] = score_of(dot, factor, softcap);
                     }
                   }
                 }
               });
}

// How far ahead of the keys being read decode_bf16 asks for their rows, into L2 (for_each_run says why).
constexpr int64_t kAheadKeys = 32;

// Rows [first, first + n) of a task's KV head h in data, kAheadKeys on, asked for.
template <typename T>
__attribute__((always_inline)) inline void prefetch_ahead(const Task<T>& t, const T* data, int64_t first, int64_t h,
                                                          int64_t n) {
  const T* ahead[16];
  t.rows_at(data, first + kAheadKeys, h, n, ahead);
  for (int64_t i = 0; i < n; ++i) {
    if (ahead[i] != nullptr) prefetch_bytes(ahead[i], t.dim * static_cast<int64_t>(sizeof(T)));
  }
}

constexpr int64_t kRowsAtOnce = 4;  // query heads decode_bf16's products take at a time

// Either of decode_bf16's products for `rows` query heads (up to kRowsAtOnce) over `vecs` vectors left (of
// keys or of output columns, an even number): run.template operator()<kRows, kVecs>() for the next ones,
// returning how many vectors it took. Up to 3 heads take 4 vectors where there are 4, so that 4 to 12 chains
// of sums (within AVX-512's 32 registers) keep vdpbf16ps busy: each waits on the one before it in its chain.
template <typename Run>
inline int64_t some_vectors(int64_t rows, int64_t vecs, Run&& run) {
  if (rows <= 3 && vecs >= 4) {
    switch (rows) {
      case 3: run.template operator()<3, 4>(); break;
      case 2: run.template operator()<2, 4>(); break;
      default: run.template operator()<1, 4>();
    }
    return 4;
  }
  switch (rows) {
    case 4: run.template operator()<4, 2>(); break;
    case 3: run.template operator()<3, 2>(); break;
    case 2: run.template operator()<2, 2>(); break;
    default: run.template operator()<1, 2>();
  }
  return 2;
}

#if defined(__x86_64__)
// A bfloat16 query over a bfloat16 pool, where vdpbf16ps runs, as paged_prefill.cpp's Bf16Block computes the
// same token's row: each key's score summed over pairs of dims in order, attention_steps.h's softmax step
// (the weights as two bfloat16 halves), each output column summed over pairs of keys in order. So a decode's
// output equals, bit for bit, what a prefill of that token gives (a batch's, a chunk's or a failover's
// recompute). K's rows go 16 keys at a time into pairs of dims, the prefill's K operand, and V's into pairs
// of keys, its V operand; a key the token does not see reads as zeros, as it does there.

// 16 rows of 16 32-bit values (r[i], row i) as 16 columns: r[p] ends with value p of row i in lane i.
DOT_BF16_TARGET inline void transpose_16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // each 128-bit block b: values 4b, 4b + 1 (even t) or 4b + 2, 4b + 3 of two rows
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {  // u[4i + c], block b: value 4b + c of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // value 4b + c: block b of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// The unscaled scores of kRows query heads (query: the first's, rows dim apart) against kBlocks blocks of 16
// keys (k: their pairs of dims, [kBlocks, D / 2, 16]), into scores (rows kStepKeys apart): each key's sum over
// the pairs in order, as the prefill's score_vectors takes them, in kRows kBlocks chains of sums at once.
template <int kRows, int kBlocks>
DOT_BF16_TARGET inline void score_rows_bf16(const uint16_t* query, const uint32_t* k, int64_t dim, float* scores) {
  using pagedserve::attention::broadcast_pair, pagedserve::attention::kStepKeys;
  __m512 sums[kRows][kBlocks];
  for (auto& row : sums) {
    for (__m512& sum : row) sum = _mm512_setzero_ps();
  }
  for (int64_t pair = 0; pair < dim / 2; ++pair) {
    __m512bh key[kBlocks];
    for (int v = 0; v < kBlocks; ++v) key[v] = (__m512bh)_mm512_loadu_si512(k + (v * dim / 2 + pair) * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh q_pair = broadcast_pair(query + r * dim + 2 * pair);
      for (int v = 0; v < kBlocks; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], q_pair, key[v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kBlocks; ++v) _mm512_storeu_ps(scores + r * kStepKeys + 16 * v, sums[r][v]);
  }
}

// acc (kRows rows dim apart, kVecs vectors of 16 columns) += the weights (high and low halves, rows kStepKeys
// apart) of a step's `keys` keys times their V pairs (pairs: [keys / 2, D], at the columns), a pair of keys at
// a time in order, as the prefill's accumulate_vectors takes them, in kRows kVecs chains of sums at once.
template <int kRows, int kVecs>
DOT_BF16_TARGET inline void add_values_bf16(const uint16_t* high, const uint16_t* low, int64_t keys,
                                            const uint32_t* pairs, int64_t dim, float* acc) {
  using pagedserve::attention::add_pair, pagedserve::attention::kStepKeys;
  __m512 sums[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) sums[r][v] = _mm512_loadu_ps(acc + r * dim + 16 * v);
  }
  for (int64_t j = 0; j < keys; j += 2) {
    __m512bh value[kVecs];
    for (int v = 0; v < kVecs; ++v) value[v] = (__m512bh)_mm512_loadu_si512(pairs + j / 2 * dim + 16 * v);
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) {
        sums[r][v] = add_pair(sums[r][v], high + r * kStepKeys + j, low + r * kStepKeys + j, value[v]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(acc + r * dim + 16 * v, sums[r][v]);
  }
}

struct Bf16Scores {
  const uint16_t* query;
  const uint32_t* k;
  int64_t dim;
  float* scores;
  template <int kRows, int kVecs>
  DOT_BF16_TARGET void operator()() const {
    score_rows_bf16<kRows, kVecs>(query, k, dim, scores);
  }
};

struct Bf16Values {
  const uint16_t *high, *low;
  int64_t keys;
  const uint32_t* pairs;
  int64_t dim;
  float* acc;
  template <int kRows, int kVecs>
  DOT_BF16_TARGET void operator()() const {
    add_values_bf16<kRows, kVecs>(high, low, keys, pairs, dim, acc);
  }
};

// A task's scratch for decode_bf16: its rows' scores, weights, sums and state, and a step's operands.
struct Bf16Scratch {
  std::vector<float> scores, acc, top, sum;  // [G, kStepKeys], [G, D], [G], [G]
  std::vector<uint16_t> high, low;            // [G, kStepKeys]
  std::vector<uint32_t> k_pairs, v_pairs;     // a step's [kStepKeys / 16, D / 2, 16] and [kStepKeys / 2, D]
};

DOT_BF16_TARGET void decode_bf16(const Task<bf16>& t, const bf16* q, float scale, float softcap, const float* sinks,
                                 float* out, Bf16Scratch& s) {
  using namespace pagedserve::attention;
  const int64_t dim = t.dim, group = t.group, pos = t.len - 1;
  s.scores.resize(group * kStepKeys);
  s.high.resize(group * kStepKeys);
  s.low.resize(group * kStepKeys);
  s.acc.resize(group * dim);
  s.top.resize(group);
  s.sum.resize(group);
  s.k_pairs.resize(kStepKeys / 2 * dim);
  s.v_pairs.resize(kStepKeys / 2 * dim);
  // V's pair of rows (j, j + 1) interleaved, 32 columns at a time: (row j's, row j + 1's) in each 32 bits.
  const __m512i first_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                               38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
  for (int64_t h = t.h0; h < t.h1; ++h) {
    const bf16* rows_q = q + (h - t.h0) * group * dim;
    for (int64_t g = 0; g < group; ++g) {
      s.top[g] = sinks ? sinks[(h - t.h0) * group + g] : -1e30f;
      s.sum[g] = sinks ? 1.0f : 0.0f;
    }
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    for (int64_t k0 = step_of(t.lo); k0 <= pos; k0 += kStepKeys) {
      const int64_t keys = std::min(kStepKeys, pos + 1 - k0);
      const int64_t blocks = round_up(keys, 32) / 16;  // of 16 keys: the scores the softmax step reads
      for (int64_t b = 0; b < blocks; ++b) {
        const bf16* key[16];
        t.rows_at(t.k_data, k0 + 16 * b, h, 16, key);
        prefetch_ahead(t, t.k_data, k0 + 16 * b, h, 16);
        for (int64_t c = 0; c < dim / 2; c += 16) {  // 16 pairs of dims
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = key[i] ? _mm512_loadu_si512(key[i] + 2 * c) : _mm512_setzero_si512();
          transpose_16x16(r);
          for (int i = 0; i < 16; ++i) _mm512_storeu_si512(s.k_pairs.data() + (b * dim / 2 + c + i) * 16, r[i]);
        }
      }
      for (int64_t g = 0; g < group; g += kRowsAtOnce) {
        const uint16_t* query = reinterpret_cast<const uint16_t*>(rows_q + g * dim);
        const int64_t rows = std::min(kRowsAtOnce, group - g);
        for (int64_t b = 0; b < blocks;) {  // blocks is even
          b += some_vectors(rows, blocks - b, Bf16Scores{query, s.k_pairs.data() + b * dim / 2 * 16, dim,
                                                        s.scores.data() + g * kStepKeys + b * 16});
        }
      }
      const int64_t lo = std::max<int64_t>(t.lo - k0, 0), hi = keys;  // seen_in_step's: t.lo is the first key seen
      for (int64_t g = 0; g < group; ++g) {
        softmax_step(s.scores.data() + g * kStepKeys, s.high.data() + g * kStepKeys, s.low.data() + g * kStepKeys,
                     lo, hi, scale, softcap, s.top[g], s.sum[g], s.acc.data() + g * dim, dim);
      }
      for (int64_t j0 = 0; j0 < keys; j0 += 16) {  // V's rows interleaved in pairs
        const int64_t n = std::min<int64_t>(16, round_up(keys - j0, 2));
        const bf16* values[16];
        t.rows_at(t.v_data, k0 + j0, h, n, values);
        prefetch_ahead(t, t.v_data, k0 + j0, h, n);
        for (int64_t i = 0; i < n; i += 2) {
          uint32_t* to = s.v_pairs.data() + (j0 + i) / 2 * dim;
          for (int64_t d = 0; d < dim; d += 32) {
            const __m512i a = values[i] ? _mm512_loadu_si512(values[i] + d) : _mm512_setzero_si512();
            const __m512i b = values[i + 1] ? _mm512_loadu_si512(values[i + 1] + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(to + d, _mm512_permutex2var_epi16(a, first_half, b));
            _mm512_storeu_si512(to + d + 16, _mm512_permutex2var_epi16(a, second_half, b));
          }
        }
      }
      for (int64_t g = 0; g < group; g += kRowsAtOnce) {
        const int64_t rows = std::min(kRowsAtOnce, group - g);
        for (int64_t d = 0; d < dim;) {  // dim is a multiple of 32
          d += 16 * some_vectors(rows, (dim - d) / 16,
                                 Bf16Values{s.high.data() + g * kStepKeys, s.low.data() + g * kStepKeys, keys,
                                           s.v_pairs.data() + d, dim, s.acc.data() + g * dim + d});
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.0f / s.sum[g];
      float* to = out + ((h - t.h0) * group + g) * dim;
      for (int64_t d = 0; d < dim; ++d) to[d] = s.acc[g * dim + d] * inv;
    }
  }
}
#endif

// Each score row as its softmax's numerators (with the sink's logit in the denominator where given); total:
// each row's 1 / denominator.
inline void softmax_rows(float* scores, int64_t rows, int64_t span, const float* sinks, float* total) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * span;
    float top = sinks ? std::max(row[0], sinks[r]) : row[0];
    for (int64_t t = 1; t < span; ++t) top = std::max(top, row[t]);
    float sum = sinks ? std::exp(sinks[r] - top) : 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < span; ++t) {
      row[t] = std::exp(row[t] - top);
      sum += row[t];
    }
    total[r] = 1.0f / sum;
  }
}

// acc [kHeads, kDim] += the weighted sum of a run's V rows of one KV head (rows, row_stride apart): kHeads
// query heads of that KV head, their weights w [kHeads, span]. The sums stay in vector registers over the
// run, and each V row is widened once for all kHeads.
template <int64_t kDim, int kHeads, typename T>
void add_values(const T* rows, int64_t count, int64_t row_stride, const float* w, int64_t span, float* acc) {
  using pagedserve::kLanes, pagedserve::Vec;
  constexpr int64_t kVecs = kDim / kLanes;
  Vec sums[kHeads][kVecs];
  for (int j = 0; j < kHeads; ++j) {
    for (int64_t c = 0; c < kVecs; ++c) sums[j][c] = pagedserve::load(acc + j * kDim + c * kLanes);
  }
  for (int64_t i = 0; i < count; ++i) {
    Vec v[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) v[c] = pagedserve::load(rows + i * row_stride + c * kLanes);
    for (int j = 0; j < kHeads; ++j) {
      const float wj = w[j * span + i];
      for (int64_t c = 0; c < kVecs; ++c) sums[j][c] += wj * v[c];
    }
  }
  for (int j = 0; j < kHeads; ++j) {
    for (int64_t c = 0; c < kVecs; ++c) pagedserve::store(acc + j * kDim + c * kLanes, sums[j][c]);
  }
}

// out: each query head's sum of V rows weighted by its softmax (weights, then total). The pages are read one
// at a time, all of the task's KV heads in each. With the head size known (kDim), add_values() takes up to
// 4 query heads of a KV head at a time (16 vector registers of sums with AVX-512: 4 heads of 64, 2 of 128);
// else each V row is widened once for its KV head's query heads.
template <int64_t kDim, typename T>
void values_of(const Task<T>& t, const float* weights, const float* total, float* out, std::vector<float>& acc,
               std::vector<float>& wide) {
  const int64_t dim = kDim > 0 ? kDim : t.dim, span = t.span(), stride = t.row_stride();
  acc.assign(t.rows() * dim, 0.0f);
  wide.resize(dim);
  for_each_run(t.table, t.lo, t.len, t.page_size, t.pages, stride, t.v_data,
               [&](int64_t first, int64_t count, const T* base) {
                 for (int64_t h = t.h0; h < t.h1; ++h) {
                   const T* rows = base + h * dim;
                   if constexpr (kDim > 0) {
                     constexpr int64_t kHeads = std::clamp<int64_t>(16 * pagedserve::kLanes / kDim, 1, 4);
                     for (int64_t g = 0; g < t.group; g += kHeads) {
                       const int64_t r0 = (h - t.h0) * t.group + g;
                       const float* w = weights + r0 * span + first - t.lo;
                       float* into = acc.data() + r0 * kDim;
                       switch (std::min<int64_t>(kHeads, t.group - g)) {
                         case 4: add_values<kDim, std::min<int64_t>(kHeads, 4)>(rows, count, stride, w, span, into); break;
                         case 3: add_values<kDim, std::min<int64_t>(kHeads, 3)>(rows, count, stride, w, span, into); break;
                         case 2: add_values<kDim, std::min<int64_t>(kHeads, 2)>(rows, count, stride, w, span, into); break;
                         default: add_values<kDim, 1>(rows, count, stride, w, span, into); break;
                       }
                     }
                     continue;
                   }
                   for (int64_t i = 0; i < count; ++i) {
#pragma omp simd
                     for (int64_t d = 0; d < dim; ++d) wide[d] = pagedserve::to_float(rows[i * stride + d]);
                     for (int64_t g = 0; g < t.group; ++g) {
                       const int64_t r = (h - t.h0) * t.group + g;
                       const float w = weights[r * span + first - t.lo + i];
                       float* into = acc.data() + r * dim;
#pragma omp simd
                       for (int64_t d = 0; d < dim; ++d) into[d] += w * wide[d];
                     }
                   }
                 }
               });
  for (int64_t r = 0; r < t.rows(); ++r) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = acc[r * dim + d] * total[r];
  }
}

// Per-thread scratch, reused across a thread's tasks.
struct Scratch {
  std::vector<float> scores, total, acc, wide;
#if defined(__x86_64__)
  Bf16Scratch bf16;
#endif
};

// One task: its queries at q (float32; q_bf16, the same as bfloat16, where decode_bf16 takes a bfloat16 pool)
// and its output at out. kDim, when not 0, is the head size known at compile time, which lets the compiler
// unroll the rows. sinks: the task's first query head's, or null.
template <int64_t kDim, typename T>
void decode_task(const Task<T>& t, const float* q, const bf16* q_bf16, float factor, float softcap,
                 const float* sinks, float* out, Scratch& scratch) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, bf16>) {
    if (q_bf16) return decode_bf16(t, q_bf16, factor, softcap, sinks, out, scratch.bf16);
  }
#endif
  scratch.scores.resize(t.rows() * t.span());
  scratch.total.resize(t.rows());
  scores_of<kDim>(t, q, factor, softcap, scratch.scores.data());
  softmax_rows(scratch.scores.data(), t.rows(), t.span(), sinks, scratch.total.data());
  values_of<kDim>(t, scratch.scores.data(), scratch.total.data(), out, scratch.acc, scratch.wide);
}

}  // namespace

// dot_bf16: a bfloat16 token over a bfloat16 pool takes decode_bf16, on vdpbf16ps (the caller has seen this CPU
// run it).
at::Tensor paged_decode(at::Tensor q, at::Tensor kv_layer, at::Tensor block_tables, at::Tensor seq_lens, double scale,
                        int64_t window, double softcap, std::optional<at::Tensor> sinks, bool dot_bf16) {
  check(q, kv_layer, block_tables, seq_lens, sinks);
  const int64_t seqs = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t pages = kv_layer.size(1), page_size = kv_layer.size(2), kv_heads = kv_layer.size(3);
  const int64_t group = q_heads / kv_heads, width = block_tables.size(1);
  const auto lens = seq_lens.contiguous();
  const int64_t* len_of = lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(len_of[s] >= 1 && len_of[s] <= width * page_size, "seq_lens[", s, "] is out of its table");
  }
  // q is read and out written in float32: [S, Hq, D] is small beside the pages read for it.
  const auto qf = q.to(at::kFloat).contiguous();
  const bool scores_bf16 = dot_bf16 && q.scalar_type() == at::kBFloat16 && dim % 32 == 0;
  const bf16* q_bf16 = scores_bf16 ? q.data_ptr<bf16>() : nullptr;  // check() made q contiguous
  auto out = at::empty_like(qf);
  const float* q_data = qf.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float factor = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const float* sink_data = sinks ? sinks->data_ptr<float>() : nullptr;
  // A task is a sequence's KV heads [h0, h1): all of them when there are sequences enough to keep every
  // thread busy, so that each page is read once; else one head a task.
  const int64_t split = seqs >= at::get_num_threads() ? 1 : kv_heads;
  const int64_t heads_per_task = kv_heads / split;
  pagedserve::with_float_type(kv_layer, "kv_layer", [&](auto tag) {
    using T = decltype(tag);
    const T* k_data = kv_layer.data_ptr<T>();
    const T* v_data = k_data + pages * page_size * kv_heads * dim;
    const auto task_of_dim =
        dim == 64 ? decode_task<64, T> : dim == 128 ? decode_task<128, T> : decode_task<0, T>;
    at::parallel_for(0, seqs * split, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / split, h0 = task % split * heads_per_task;
        const int64_t offset = (s * q_heads + h0 * group) * dim;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, len_of[s] - window) : 0;
        const Task<T> t{tables + s * width, lo, len_of[s], h0, h0 + heads_per_task, group, page_size,
                        kv_heads, pages, dim, k_data, v_data};
        task_of_dim(t, q_data + offset, q_bf16 ? q_bf16 + offset : nullptr, factor, cap,
                    sink_data ? sink_data + h0 * group : nullptr, out_data + offset, scratch);
      }
    });
  });
  return out.to(q.scalar_type());
}
