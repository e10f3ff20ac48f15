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
constexpr int64_t kRunRows = 4;        // the rows of a run, where the body does not ask for more

// The rows a run asks for ahead of it: the same rows of the page kPrefetchPages ahead, count of them (fewer
// past the sequence's end, none where that page is not the pool's).
template <typename T>
struct Ahead {
  const T* rows = nullptr;
  int64_t count = 0, row_stride = 0;

  // Rows [first, first + n) of them, one after another in their page, into L2 (prefetcht2). Always inlined:
  // GCC 12 finds a function that only prefetches free of side effects, and drops every call to it.
  __attribute__((always_inline)) void prefetch(int64_t first, int64_t n = 1) const {
    const int64_t end = std::min(first + n, count);
    if (end <= first) return;
    const char* from = reinterpret_cast<const char*>(rows + first * row_stride);
    const int64_t bytes = (end - first) * row_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(from + b, 0, 1);
  }
};

// The tokens [lo, len) of a sequence as runs of up to kRows that lie in one page each: body(token, count, the
// run's first row). The hardware's prefetchers do not follow a block table, and without help a thread spent
// most of its time waiting for each page (scripts/bench_cpu_ops.py times the op): so before each run the same
// rows of the page kPrefetchPages ahead are asked for (Ahead). A page's rows all at once, before its first
// run, filled the core's miss buffers: `perf annotate` put a third of the scores' samples and nearly all of
// the values' page walk on the instruction after the prefetches. Into L1 (prefetcht0), or one page ahead, was
// slower. A body that takes a whole page a run asks for them itself, a row as it reaches each
// (kBodyPrefetches: body(token, count, first row, ahead)).
template <int64_t kRows = kRunRows, bool kBodyPrefetches = false, typename T, typename Body>
void for_each_run(const int64_t* table, int64_t lo, int64_t len, int64_t page_size, int64_t pages,
                  int64_t row_stride, const T* data, Body&& body) {
  for (int64_t first = lo; first < len;) {
    const int64_t page = table[first / page_size], offset = first % page_size;
    TORCH_CHECK(page >= 0 && page < pages, "block_tables holds page ", page, ", outside the pool");
    const int64_t count = std::min({page_size - offset, len - first, kRows});
    Ahead<T> ahead{nullptr, 0, row_stride};
    if (const int64_t slot = first + kPrefetchPages * page_size; slot < len) {  // the same slot, pages ahead
      const int64_t later = table[slot / page_size];
      if (later >= 0 && later < pages) {  // else its own run refuses it
        ahead.rows = data + (later * page_size + offset) * row_stride;
        ahead.count = std::min(count, len - slot);
      }
    }
    const T* rows = data + (page * page_size + offset) * row_stride;
    if constexpr (kBodyPrefetches) {
      body(first, count, rows, ahead);
    } else {
      ahead.prefetch(0, ahead.count);
      body(first, count, rows);
    }
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

#if defined(__x86_64__)
// The 16 lane sums of v[0..15], in one vector: a tree of unpacks and shuffles, 15 vector adds in all.
DOT_BF16_TARGET inline __m512 sum_lanes_of_16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // each 128-bit block of x[i]: the block's sums of v[4i .. 4i + 3]
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// scores_of() for bfloat16 q and K with vdpbf16ps (kDim a multiple of 32): a key's dot product is kDim / 32
// instructions into one vector, and 16 keys' vectors are summed across their lanes together.
template <int64_t kDim>
DOT_BF16_TARGET void scores_of_bf16(const Task<bf16>& t, const bf16* q, float factor, float softcap,
                                    float* scores) {
  constexpr int64_t kChunks = kDim / 32;
  const int64_t span = t.span();
  // Runs of 16 rows, the keys summed across their lanes together, each key's row of the page ahead asked for
  // as the first query head reaches the key: the page's 16 rows at once before the run left the op waiting
  // on them (32 sequences of 480 over 30 layers' pools that stream from memory: 24.7 against 22.7 ms, the
  // medians of both builds alternated in one process on a Zen 4). The lambda names the target itself: GCC
  // does not pass a function's target to the lambdas inside it.
  for_each_run<16, true>(t.table, t.lo, t.len, t.page_size, t.pages, t.row_stride(), t.k_data,
                   [&](int64_t first, int64_t count, const bf16* base, const Ahead<bf16>& ahead) DOT_BF16_TARGET {
                   for (int64_t h = t.h0; h < t.h1; ++h) {
                     for (int64_t g = 0; g < t.group; ++g) {
                       const int64_t r = (h - t.h0) * t.group + g;
                       __m512bh query[kChunks];
                       for (int64_t c = 0; c < kChunks; ++c) {
                         query[c] = (__m512bh)_mm512_loadu_si512(q + r * kDim + 32 * c);
                       }
                       float* row = scores + r * span + (first - t.lo);
                       for (int64_t i0 = 0; i0 < count; i0 += 16) {
                         const int64_t keys = std::min<int64_t>(16, count - i0);
                         __m512 dots[16];
                         for (int64_t i = 0; i < 16; ++i) {
                           dots[i] = _mm512_setzero_ps();
                           if (i >= keys) continue;
                           if (h == t.h0 && g == 0) ahead.prefetch(i0 + i);
                           const bf16* key = base + (i0 + i) * t.row_stride() + h * kDim;
                           for (int64_t c = 0; c < kChunks; ++c) {
                             dots[i] = _mm512_dpbf16_ps(dots[i], query[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
                           }
                         }
                         const __m512 sums = _mm512_mul_ps(sum_lanes_of_16(dots), _mm512_set1_ps(factor));
                         _mm512_mask_storeu_ps(row + i0, __mmask16((1u << keys) - 1), sums);
                         if (softcap > 0.0f) {
                           for (int64_t i = 0; i < keys; ++i) row[i0 + i] = softcap * std::tanh(row[i0 + i] / softcap);
                         }
                       }
                     }
                   }
                 });
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
};

// One task: its queries at q (float32; q_bf16, the same as bfloat16, where the scores take vdpbf16ps) and its
// output at out. kDim, when not 0, is the head size known at compile time, which lets the compiler unroll the
// rows. sinks: the task's first query head's, or null.
template <int64_t kDim, typename T>
void decode_task(const Task<T>& t, const float* q, const bf16* q_bf16, float factor, float softcap,
                 const float* sinks, float* out, Scratch& scratch) {
  scratch.scores.resize(t.rows() * t.span());
  scratch.total.resize(t.rows());
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, bf16> && kDim % 32 == 0 && kDim > 0) {
    if (q_bf16) {
      scores_of_bf16<kDim>(t, q_bf16, factor, softcap, scratch.scores.data());
    } else {
      scores_of<kDim>(t, q, factor, softcap, scratch.scores.data());
    }
  } else
#endif
  {
    scores_of<kDim>(t, q, factor, softcap, scratch.scores.data());
  }
  softmax_rows(scratch.scores.data(), t.rows(), t.span(), sinks, scratch.total.data());
  values_of<kDim>(t, scratch.scores.data(), scratch.total.data(), out, scratch.acc, scratch.wide);
}

}  // namespace

// dot_bf16: score bfloat16 keys with vdpbf16ps (the caller has seen this CPU run it).
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
