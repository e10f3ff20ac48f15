// Paged decode attention on the CPU: one query token a sequence, reading K and V where they lie in the
// pool's pages, with no gather into a copy of the context and no read past a sequence's length (so a page
// slot that holds no valid data never reaches the softmax, whatever it holds).
//
// q [S, Hq, D], kv_layer [2, P, B, Hkv, D], block_tables [S, W] (int64), seq_lens [S] (int64); q and the pool
// float32 or bfloat16, computed in float32.
// Each KV head's G = Hq / Hkv query heads share each K and V row read for them. window > 0: each query reads
// only the last `window` tokens, its own included (a sliding-window layer; the pages before may be gone).
// softcap > 0: scores become softcap * tanh(scores / softcap). sinks [Hq]: a logit per query head that joins
// the softmax's denominator and brings no value.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "checks.h"
#include "floats.h"

namespace {

void check(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
           const torch::Tensor& lens, const std::optional<torch::Tensor>& sinks) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_shape, pagedserve::kAny;
  pagedserve::check_attention(q, "S", kv, sinks);
  const int64_t seqs = q.size(0);
  check_cpu(tables, "block_tables", torch::kInt64);
  check_shape(tables, "block_tables", {seqs, kAny}, "[", seqs, ", W]");
  check_contiguous(tables, "block_tables");
  check_cpu(lens, "seq_lens", torch::kInt64);
  check_shape(lens, "seq_lens", {seqs}, "[", seqs, "]");
}

// The softcapped, scaled score of one query and key row.
inline float score_of(float dot, float factor, float softcap) {
  const float score = dot * factor;
  return softcap > 0.0f ? softcap * std::tanh(score / softcap) : score;
}


// One task: a sequence's KV heads [h0, h1), its queries at q and its output at out, over its tokens
// [lo, len). K and V are read page by page, each page once while it sits in L1; kDim, when not 0, is the head
// size known at compile time, which lets the compiler unroll the rows. sinks: the task's first query head's,
// or null.
template <int64_t kDim, typename T>
void decode_task(const float* q, const T* k_data, const T* v_data, const int64_t* table, int64_t lo,
                 int64_t len, int64_t h0, int64_t h1, int64_t group, int64_t page_size, int64_t kv_heads,
                 int64_t pages, int64_t dim_rt, float factor, float softcap, const float* sinks, float* out,
                 std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& total) {
  const int64_t dim = kDim > 0 ? kDim : dim_rt;
  const int64_t rows = (h1 - h0) * group, span = len - lo;
  const int64_t row_stride = kv_heads * dim;  // floats between consecutive tokens of a page
  scores.resize(rows * span);
  for (int64_t first = lo; first < len;) {
    const int64_t page = table[first / page_size], offset = first % page_size;
    TORCH_CHECK(page >= 0 && page < pages, "block_tables holds page ", page, ", outside the pool");
    const int64_t count = std::min(page_size - offset, len - first);
    const T* base = k_data + (page * page_size + offset) * row_stride;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - h0) * group + g;
        const float* query = q + r * dim;
        float* row = scores.data() + r * span + (first - lo);
        for (int64_t t = 0; t < count; ++t) {
          const T* key = base + t * row_stride + h * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += query[d] * pagedserve::to_float(key[d]);
          row[t] = score_of(dot, factor, softcap);
        }
      }
    }
    first += count;
  }
  total.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores.data() + r * span;
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
  acc.assign(rows * dim, 0.0f);
  for (int64_t first = lo; first < len;) {
    const int64_t page = table[first / page_size], offset = first % page_size;
    const int64_t count = std::min(page_size - offset, len - first);
    const T* base = v_data + (page * page_size + offset) * row_stride;
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - h0) * group + g;
        const float* weights = scores.data() + r * span + (first - lo);
        float* into = acc.data() + r * dim;
        for (int64_t t = 0; t < count; ++t) {
          const float w = weights[t];
          const T* value = base + t * row_stride + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) into[d] += w * pagedserve::to_float(value[d]);
        }
      }
    }
    first += count;
  }
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = acc[r * dim + d] * total[r];
  }
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                           std::optional<torch::Tensor> sinks) {
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
  const auto qf = q.to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(qf);
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
      std::vector<float> scores, acc, total;  // reused across a thread's tasks
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / split, h0 = task % split * heads_per_task;
        const int64_t offset = (s * q_heads + h0 * group) * dim;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, len_of[s] - window) : 0;
        task_of_dim(q_data + offset, k_data, v_data, tables + s * width, lo, len_of[s], h0, h0 + heads_per_task,
                    group, page_size, kv_heads, pages, dim, factor, cap,
                    sink_data ? sink_data + h0 * group : nullptr, out_data + offset, scores, acc, total);
      }
    });
  });
  return out.to(q.scalar_type());
}
