// The argument checks the CPU ops share, made before an op reads an element: each raises a ValueError (as
// pagedserve/kernels/cuda_ops.py's checks do) naming the argument, what it must be and what it was given. The message
// parts are evaluated only when a check fails, so a passing check costs a few compares.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace pagedserve {

constexpr int64_t kAny = -1;  // a size check_shape takes whatever it is

// t is on the CPU and of this dtype.
inline void check_cpu(const at::Tensor& t, const char* name, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, not ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", c10::getDtypeNames(dtype).first, ", not ",
                    c10::getDtypeNames(t.scalar_type()).first);
}

// t is on the CPU and float32 or bfloat16 (a model's or a KV pool's dtype), which the ops compute in float32.
inline void check_cpu_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, not ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                    " must be float32 or bfloat16, not ", c10::getDtypeNames(t.scalar_type()).first);
}

inline bool has_sizes(const at::Tensor& t, std::initializer_list<int64_t> sizes) {
  if (t.dim() != static_cast<int64_t>(sizes.size())) return false;
  int64_t i = 0;
  for (const int64_t size : sizes) {
    if (size != kAny && t.size(i) != size) return false;
    ++i;
  }
  return true;
}

// t has these sizes (kAny: any size); `expected` spells them for the message, e.g. "[", n, ", W]".
template <typename... Expected>
void check_shape(const at::Tensor& t, const char* name, std::initializer_list<int64_t> sizes,
                 const Expected&... expected) {
  TORCH_CHECK_VALUE(has_sizes(t, sizes), name, " must be ", expected..., ", not ", t.sizes());
}

// The ops walk each row of t with a stride of one element.
inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have a contiguous last dimension, not strides ", t.strides());
}

// The ops index t as one dense block.
inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, not strides ", t.strides());
}

// An attention op's queries q [rows, Hq, D] (`rows` spells its first size), the pool's layer kv [2, P, B, Hkv,
// D], with Hq a multiple of Hkv, and sinks [Hq] where given. q and kv are each float32 or bfloat16: a pool may
// be narrower than its model (--kv-cache-dtype), and the ops compute in float32 either way.
inline void check_attention(const at::Tensor& q, const char* rows, const at::Tensor& kv,
                            const std::optional<at::Tensor>& sinks) {
  check_cpu_float(q, "q");
  check_shape(q, "q", {kAny, kAny, kAny}, "[", rows, ", Hq, D]");
  check_contiguous(q, "q");
  const int64_t q_heads = q.size(1), dim = q.size(2);
  check_cpu_float(kv, "kv_layer");
  check_shape(kv, "kv_layer", {2, kAny, kAny, kAny, dim}, "[2, P, B, Hkv, ", dim, "]");
  check_contiguous(kv, "kv_layer");
  TORCH_CHECK_VALUE(kv.size(3) > 0 && q_heads % kv.size(3) == 0, q_heads, " query heads over ", kv.size(3),
                    " KV heads");
  if (sinks) {
    check_cpu(*sinks, "sinks");
    check_shape(*sinks, "sinks", {q_heads}, "[", q_heads, "]");
    check_contiguous(*sinks, "sinks");
  }
}

}  // namespace pagedserve
