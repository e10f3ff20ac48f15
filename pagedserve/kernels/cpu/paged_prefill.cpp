// Paged prefill attention on the CPU: each sequence's chunk of new query tokens attends causally to its
// cached prefix and to itself, reading K and V where they lie in the pool's pages, in float32 whatever the
// pool's dtype, in the manner of FlashAttention: a running max and sum a query row, so no [n, L] score matrix.
//
// q [N, Hq, D]: the chunks one after another, sequence s's rows q[query_start[s]:query_start[s + 1]], at the
// positions seq_lens[s] - n_s .. seq_lens[s] - 1. kv_layer [2, P, B, Hkv, D], block_tables [S, W], seq_lens
// [S], query_start [S + 1] (int64). window, softcap and sinks as in paged_decode.cpp.
//
// A task is one KV head of a block of kQueryBlock tokens of one sequence: its rows are those tokens' query
// heads of that KV head, which share every K and V row read. Keys come in tiles of kKeyTile, gathered from
// their pages and widened to float32; K is laid out transposed, so that a row's scores against the tile are a
// few vectors of FMAs with no horizontal sums. The tasks go to the threads by their cost (a causal chunk's
// last block sees the most keys), longest first.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

#include "checks.h"
#include "floats.h"

namespace {

using pagedserve::kLanes, pagedserve::load, pagedserve::store, pagedserve::to_float, pagedserve::Vec;

constexpr int64_t kQueryBlock = 16;          // tokens a task
constexpr int64_t kKeyVecs = 4;              // a key tile's vectors of scores a row
constexpr int64_t kKeyTile = kKeyVecs * kLanes;  // keys a tile: 32 with AVX2, 64 with AVX-512

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

// The keys a query at position p sees: [lo, p].
inline int64_t first_key(int64_t p, int64_t window) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }

template <int64_t kDim, typename T>
class Block {
 public:
  Block(const Shape& shape) : s_(shape), dim_(kDim > 0 ? kDim : shape.dim) {}

  // One task: rows r = token * group + g, queries at q_rows (float32, [count * group, D] with a stride of Hq
  // * D between tokens), out likewise.
  void run(const float* q, const T* k_data, const T* v_data, const int64_t* table, int64_t cached,
           const Task& task, const float* sinks, float* out) {
    const int64_t group = s_.group, rows = task.count * group, dim = dim_;
    const int64_t token_stride = s_.q_heads * dim;
    q_.resize(rows * dim);
    acc_.assign(rows * dim, 0.0f);
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
    for (int64_t k0 = first_key(first_pos, s_.window); k0 <= last_pos; k0 += kKeyTile) {
      const int64_t keys = std::min(kKeyTile, last_pos + 1 - k0);
      gather(k_data, v_data, table, k0, keys, task.head);
      float scores[2][kKeyTile];
      for (int64_t r = 0; r < rows; r += 2) {
        const int64_t count = std::min<int64_t>(2, rows - r);
        score(r, count, scores);
        for (int64_t k = 0; k < count; ++k) {
          const int64_t p = first_pos + (r + k) / group;  // the row's token's position
          const int64_t lo = std::max<int64_t>(first_key(p, s_.window) - k0, 0), hi = std::min(p + 1 - k0, keys);
          if (lo < hi) update(r + k, scores[k], lo, hi);  // else this token sees none of the tile
        }
      }
    }
    for (int64_t i = 0; i < task.count; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        const float inv = 1.0f / sum_[r];
        float* to = out + i * token_stride + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) to[d] = acc_[r * dim + d] * inv;
      }
    }
  }

 private:
  // Keys [k0, k0 + keys) of KV head h into kt_ ([D, kKeyTile], transposed) and vt_ ([kKeyTile, D]), float32;
  // the tile's unused columns are zero.
  void gather(const T* k_data, const T* v_data, const int64_t* table, int64_t k0, int64_t keys, int64_t h) {
    const int64_t dim = dim_, row_stride = s_.kv_heads * dim;
    kt_.resize(dim * kKeyTile);
    vt_.resize(kKeyTile * dim);
    if (keys < kKeyTile) {  // a short last tile: its empty columns score zero, never used, never garbage
      for (int64_t d = 0; d < dim; ++d) std::fill_n(kt_.data() + d * kKeyTile + keys, kKeyTile - keys, 0.0f);
    }
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t pos = k0 + j, page = table[pos / s_.page_size];
      TORCH_CHECK(page >= 0 && page < s_.pages, "block_tables holds page ", page, ", outside the pool");
      const int64_t at = (page * s_.page_size + pos % s_.page_size) * row_stride + h * dim;
      const T* key = k_data + at;
      const T* value = v_data + at;
      for (int64_t d = 0; d < dim; ++d) kt_[d * kKeyTile + j] = to_float(key[d]);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) vt_[j * dim + d] = to_float(value[d]);
    }
  }

  // The scaled scores of rows r and r + 1 (r alone when count is 1) against each key of the tile: two rows
  // at a time share each K vector loaded.
  void score(int64_t r, int64_t count, float (&out)[2][kKeyTile]) const {
    const int64_t dim = dim_;
    const float* first = q_.data() + r * dim;
    const float* second = count > 1 ? first + dim : first;
    Vec a[kKeyVecs] = {}, b[kKeyVecs] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float* keys = kt_.data() + d * kKeyTile;
      const float qa = first[d], qb = second[d];
      for (int64_t v = 0; v < kKeyVecs; ++v) {
        const Vec k = load(keys + v * kLanes);
        a[v] += qa * k;
        b[v] += qb * k;
      }
    }
    for (int64_t v = 0; v < kKeyVecs; ++v) {
      store(out[0] + v * kLanes, a[v]);
      store(out[1] + v * kLanes, b[v]);
    }
  }

  // Row r's running max, sum and output, after its scores (row) against the tile's keys [lo, hi).
  void update(int64_t r, float* row, int64_t lo, int64_t hi) {
    float top = top_[r];
    for (int64_t j = lo; j < hi; ++j) {
      if (s_.softcap > 0.0f) row[j] = s_.softcap * std::tanh(row[j] / s_.softcap);
      top = std::max(top, row[j]);
    }
    const float rescale = std::exp(top_[r] - top);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = lo; j < hi; ++j) {
      row[j] = std::exp(row[j] - top);
      sum += row[j];
    }
    top_[r] = top;
    sum_[r] = sum_[r] * rescale + sum;
    float* acc = acc_.data() + r * dim_;
    if (dim_ % kLanes != 0) {  // a head too narrow for the vectors: one float at a time
      for (int64_t d = 0; d < dim_; ++d) acc[d] *= rescale;
      for (int64_t j = lo; j < hi; ++j) {
        for (int64_t d = 0; d < dim_; ++d) acc[d] += row[j] * vt_[j * dim_ + d];
      }
      return;
    }
    int64_t d0 = 0;  // the output in runs of 8, 4, 2 or 1 vectors, each held in registers over the keys
    for (; d0 + 8 * kLanes <= dim_; d0 += 8 * kLanes) accumulate<8>(acc, d0, row, lo, hi, rescale);
    for (int vecs = 4; vecs >= 1; vecs /= 2) {
      if (d0 + vecs * kLanes > dim_) continue;
      if (vecs == 4) accumulate<4>(acc, d0, row, lo, hi, rescale);
      if (vecs == 2) accumulate<2>(acc, d0, row, lo, hi, rescale);
      if (vecs == 1) accumulate<1>(acc, d0, row, lo, hi, rescale);
      d0 += vecs * kLanes;
    }
  }

  // acc[d0 .. d0 + kVecs lanes) = acc * rescale + sum over keys [lo, hi) of weights[j] * V[j].
  template <int kVecs>
  void accumulate(float* acc, int64_t d0, const float* weights, int64_t lo, int64_t hi, float rescale) const {
    Vec out[kVecs];
    for (int v = 0; v < kVecs; ++v) out[v] = load(acc + d0 + v * kLanes) * rescale;
    for (int64_t j = lo; j < hi; ++j) {
      const float w = weights[j];
      const float* value = vt_.data() + j * dim_ + d0;
      for (int v = 0; v < kVecs; ++v) out[v] += w * load(value + v * kLanes);
    }
    for (int v = 0; v < kVecs; ++v) store(acc + d0 + v * kLanes, out[v]);
  }

  const Shape s_;
  const int64_t dim_;
  std::vector<float> q_, acc_, top_, sum_, kt_, vt_;
};

void check(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables, const torch::Tensor& lens,
           const torch::Tensor& starts, const std::optional<torch::Tensor>& sinks) {
  using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_shape, pagedserve::kAny;
  pagedserve::check_attention(q, "N", kv, sinks);
  check_cpu(tables, "block_tables", torch::kInt64);
  check_shape(tables, "block_tables", {kAny, kAny}, "[S, W]");
  check_contiguous(tables, "block_tables");
  const int64_t seqs = tables.size(0);
  check_cpu(lens, "seq_lens", torch::kInt64);
  check_shape(lens, "seq_lens", {seqs}, "[", seqs, "]");
  check_contiguous(lens, "seq_lens");
  check_cpu(starts, "query_start", torch::kInt64);
  check_shape(starts, "query_start", {seqs + 1}, "[", seqs + 1, "]");
  check_contiguous(starts, "query_start");
}

}  // namespace

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor query_start, double scale, int64_t window,
                            double softcap, std::optional<torch::Tensor> sinks) {
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
  const auto qf = q.to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(qf);
  const float* q_data = qf.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const float* sink_data = sinks ? sinks->data_ptr<float>() : nullptr;
  pagedserve::with_float_type(kv_layer, "kv_layer", [&](auto tag) {
    using T = decltype(tag);
    const T* k_data = kv_layer.data_ptr<T>();
    const T* v_data = k_data + shape.pages * shape.page_size * shape.kv_heads * shape.dim;
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t thread = begin; thread < end; ++thread) {
        auto run_all = [&](auto block) {
          for (const Task& task : share[thread]) {
            const int64_t n = start_of[task.seq + 1] - start_of[task.seq];
            const int64_t offset = ((start_of[task.seq] + task.first) * shape.q_heads + task.head * shape.group) * shape.dim;
            block.run(q_data + offset, k_data, v_data, tables + task.seq * width, len_of[task.seq] - n, task,
                      sink_data ? sink_data + task.head * shape.group : nullptr, out_data + offset);
          }
        };
        if (shape.dim == 64) {
          run_all(Block<64, T>(shape));
        } else if (shape.dim == 128) {
          run_all(Block<128, T>(shape));
        } else {
          run_all(Block<0, T>(shape));
        }
      }
    });
  });
  return out.to(q.scalar_type());
}
