// RMSNorm with the residual add fused in, rounded as transformers rounds: the sum x + residual in the
// model dtype, the normalization in float, the normalized value in the model dtype, then times the weight.
//   x:          rows of `hidden` elements; row r starts at (r / heads) * token_stride + (r % heads) * head_stride
//               (heads == 1 for a [T, H] matrix; heads > 1 for per-head norms of a [T, heads, D] view)
//   residual:   [rows, hidden] contiguous, or null
//   out:        [rows, hidden] contiguous, the normalized rows
//   residual_out: [rows, hidden] contiguous, x + residual (may be the residual itself); unused without one
// grid: (rows); block: a multiple of 32 threads.

extern "C" __global__ void rms_norm(scalar_t* __restrict__ out, scalar_t* residual_out, const scalar_t* __restrict__ x,
                                    const scalar_t* residual, const scalar_t* __restrict__ weight, int hidden,
                                    int heads, long long token_stride, long long head_stride, float eps) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const scalar_t* in = x + (row / heads) * token_stride + (row % heads) * head_stride;
  const long long base = row * hidden;
  float sum_squares = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float value = to_float(in[i]);
    if (residual != nullptr) {
      const scalar_t summed = from_float(to_float(residual[base + i]) + value);
      residual_out[base + i] = summed;
      value = to_float(summed);
    }
    sum_squares += value * value;
  }
  const float scale = rsqrtf(block_sum(sum_squares, scratch) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float value = residual != nullptr ? to_float(residual_out[base + i]) : to_float(in[i]);
    const float normed = to_float(from_float(value * scale));
    out[base + i] = from_float(to_float(weight[i]) * normed);
  }
}
