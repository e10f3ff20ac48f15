// A step's new keys and values into their slots of the pool: each token's rows copied once, on all threads
// (rounded where the pool is narrower than the model), from k and v where they lie (views of the fused QKV
// output's wider rows). torch's index_copy_, a pass for K and one for V, took about six times as long.

#include <ATen/core/Tensor.h>

#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

#include "checks.h"
#include "floats.h"

namespace {

constexpr int64_t kTokensPerTask = 64;  // a task copies at least this many tokens' rows: waking a thread costs more

// Rows [T, heads, dim] of From (strides token_stride and head_stride) into slots of To's half [P * B, heads, dim].
template <typename From, typename To>
void write_half(const From* rows, int64_t token_stride, int64_t head_stride, const int64_t* slots, To* half,
                int64_t tokens, int64_t heads, int64_t dim) {
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding
      To* to = half + slots[t] * heads * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const From* from = rows + t * token_stride + h * head_stride;
        if constexpr (std::is_same_v<From, To>) {
          std::memcpy(to + h * dim, from, dim * sizeof(To));
        } else {
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) to[h * dim + d] = pagedserve::from_float<To>(pagedserve::to_float(from[d]));
        }
      }
    }
  });
}

}  // namespace

// k, v [T, Hkv, D] into kv_layer [2, P, B, Hkv, D] at slot_mapping [T] (int64): slot s is page s / B's row s % B.
// A negative slot is a padding row (CUDA graphs pad with -1), which writes nothing.
void write_kv(at::Tensor kv_layer, at::Tensor k, at::Tensor v, at::Tensor slot_mapping) {
  using pagedserve::check_cpu, pagedserve::check_cpu_float, pagedserve::check_rows, pagedserve::check_shape,
      pagedserve::kAny;
  check_cpu_float(kv_layer, "kv_layer");
  check_shape(kv_layer, "kv_layer", {2, kAny, kAny, kAny, kAny}, "[2, P, B, Hkv, D]");
  pagedserve::check_contiguous(kv_layer, "kv_layer");
  const int64_t slots = kv_layer.size(1) * kv_layer.size(2), heads = kv_layer.size(3), dim = kv_layer.size(4);
  check_cpu_float(k, "k");
  check_shape(k, "k", {kAny, heads, dim}, "[T, ", heads, ", ", dim, "]");
  check_rows(k, "k");
  const int64_t tokens = k.size(0);
  check_cpu(v, "v", k.scalar_type());
  check_shape(v, "v", {tokens, heads, dim}, "[", tokens, ", ", heads, ", ", dim, "]");
  check_rows(v, "v");
  check_cpu(slot_mapping, "slot_mapping", at::kLong);
  check_shape(slot_mapping, "slot_mapping", {tokens}, "[", tokens, "]");
  const auto slot_of = slot_mapping.contiguous();
  const int64_t* at_slot = slot_of.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // before any row is written, so that a refused call changes nothing
    TORCH_CHECK_INDEX(at_slot[t] < slots, "slot ", at_slot[t], " is past the pool's ", slots, " slots");
  }
  pagedserve::with_float_type(k, "k", [&](auto from_tag) {
    using From = decltype(from_tag);
    pagedserve::with_float_type(kv_layer, "kv_layer", [&](auto to_tag) {
      using To = decltype(to_tag);
      To* pool = kv_layer.data_ptr<To>();
      const From* keys = k.data_ptr<From>();
      const From* values = v.data_ptr<From>();
      write_half(keys, k.stride(0), k.stride(1), at_slot, pool, tokens, heads, dim);
      write_half(values, v.stride(0), v.stride(1), at_slot, pool + slots * heads * dim, tokens, heads, dim);
    });
  });
}
