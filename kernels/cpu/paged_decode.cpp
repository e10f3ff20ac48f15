// Paged decode attention on the CPU: one query token a sequence, reading K and V where they lie in the
// pool's pages, with no gather into a copy of the context and no read past a sequence's length (so a page
// slot that holds no valid data never reaches the softmax, whatever it holds).
//
// q [S, Hq, D], kv_layer [2, P, B, Hkv, D], block_tables [S, W] (int64), seq_lens [S] (int64); float32.
// Each KV head's G = Hq / Hkv query heads share each K and V row read for them.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

void check(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
           const torch::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32,
              "q must be a contiguous float32 [S, Hq, D]");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous() && kv.scalar_type() == torch::kFloat32,
              "kv_layer must be a contiguous float32 [2, P, B, Hkv, D]");
  TORCH_CHECK(kv.size(4) == q.size(2) && q.size(1) % kv.size(3) == 0, "q and kv_layer disagree on heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.scalar_type() == torch::kInt64 &&
                  tables.is_contiguous(),
              "block_tables must be a contiguous int64 [S, W]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == q.size(0) && lens.scalar_type() == torch::kInt64,
              "seq_lens must be an int64 [S]");
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale) {
  check(q, kv_layer, block_tables, seq_lens);
  const int64_t seqs = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t pages = kv_layer.size(1), page_size = kv_layer.size(2), kv_heads = kv_layer.size(3);
  const int64_t group = q_heads / kv_heads, width = block_tables.size(1);
  const auto lens = seq_lens.contiguous();
  const int64_t* len_of = lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(len_of[s] >= 1 && len_of[s] <= width * page_size, "seq_lens[", s, "] is out of its table");
  }
  auto out = torch::empty_like(q);
  const float* q_data = q.data_ptr<float>();
  const float* k_data = kv_layer.data_ptr<float>();
  const float* v_data = k_data + pages * page_size * kv_heads * dim;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float factor = static_cast<float>(scale);

  // A task is a sequence's KV heads [h0, h1): all of them when there are sequences enough to keep every
  // thread busy, so that each K and V row (all heads, contiguous) is read once; else one head a task.
  const int64_t split = seqs >= at::get_num_threads() ? 1 : kv_heads;
  const int64_t heads_per_task = kv_heads / split;
  at::parallel_for(0, seqs * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    std::vector<float> total;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / split, h0 = task % split * heads_per_task, len = len_of[s];
      const int64_t rows = heads_per_task * group;  // the query heads of this task
      const float* queries = q_data + (s * q_heads + h0 * group) * dim;
      const int64_t* table = tables + s * width;
      scores.assign(rows * len, 0.0f);
      for (int64_t t = 0; t < len; ++t) {  // scores[r, t] = q_r . k_t, r = (h - h0) * group + g
        const int64_t page = table[t / page_size];
        TORCH_CHECK(page >= 0 && page < pages, "block_tables holds page ", page, ", outside the pool");
        const float* keys = k_data + ((page * page_size + t % page_size) * kv_heads + h0) * dim;
        for (int64_t r = 0; r < rows; ++r) {
          const float* query = queries + r * dim;
          const float* key = keys + (r / group) * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += query[d] * key[d];
          scores[r * len + t] = dot * factor;
        }
      }
      total.assign(rows, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {  // softmax over t, kept unnormalized until the end
        float* row = scores.data() + r * len;
        const float top = *std::max_element(row, row + len);
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) sum += (row[t] = std::exp(row[t] - top));
        total[r] = sum;
      }
      acc.assign(rows * dim, 0.0f);
      for (int64_t t = 0; t < len; ++t) {  // acc[r] = sum_t p[r, t] v_t
        const int64_t page = table[t / page_size];
        const float* values = v_data + ((page * page_size + t % page_size) * kv_heads + h0) * dim;
        for (int64_t r = 0; r < rows; ++r) {
          const float weight = scores[r * len + t];
          const float* value = values + (r / group) * dim;
          float* into = acc.data() + r * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) into[d] += weight * value[d];
        }
      }
      float* result = out_data + (s * q_heads + h0 * group) * dim;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < dim; ++d) result[r * dim + d] = acc[r * dim + d] / total[r];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over the pool's pages (float32, CPU)");
}
