// The argument checks the CPU ops share, made before an op reads an element: each raises a ValueError (as
// kernels/cuda_ops.py's checks do) naming the argument, what it must be and what it was given. The message
// parts are evaluated only when a check fails, so a passing check costs a few compares.

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <initializer_list>

namespace pagedserve {

constexpr int64_t kAny = -1;  // a size check_shape takes whatever it is

// t is on the CPU and of this dtype.
inline void check_cpu(const torch::Tensor& t, const char* name, torch::ScalarType dtype = torch::kFloat32) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, not ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", c10::getDtypeNames(dtype).first, ", not ",
                    c10::getDtypeNames(t.scalar_type()).first);
}

inline bool has_sizes(const torch::Tensor& t, std::initializer_list<int64_t> sizes) {
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
void check_shape(const torch::Tensor& t, const char* name, std::initializer_list<int64_t> sizes,
                 const Expected&... expected) {
  TORCH_CHECK_VALUE(has_sizes(t, sizes), name, " must be ", expected..., ", not ", t.sizes());
}

// The ops walk each row of t with a stride of one element.
inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have a contiguous last dimension, not strides ", t.strides());
}

// The ops index t as one dense block.
inline void check_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, not strides ", t.strides());
}

}  // namespace pagedserve
