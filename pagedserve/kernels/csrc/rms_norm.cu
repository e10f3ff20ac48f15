// RMSNorm with the residual add fused in, rounded as transformers rounds: the sum x + residual in the
// model dtype, the normalization in float, the normalized value in the model dtype, then times the weight.
//   x:          rows of `hidden` elements; row r starts at (r / heads) * token_stride + (r % heads) * head_stride
//               (heads == 1 for a [T, H] matrix; heads > 1 for per-head norms of a [T, heads, D] view)
//   residual:   [rows, hidden] contiguous, or null
//   out:        [rows, hidden] contiguous, the normalized rows
//   residual_out: [rows, hidden] contiguous, x + residual (may be the residual itself); unused without one
// Compile-time: VEC, and ITEMS, the packs of VEC elements each thread holds: the whole row stays in
// registers between the sum of squares and the output, so it is read once.
// grid: (rows); block: a multiple of 32 threads, with blockDim.x * ITEMS * VEC >= hidden.

extern "C" __global__ void rms_norm(scalar_t* __restrict__ out, scalar_t* residual_out, const scalar_t* __restrict__ x,
                                    const scalar_t* residual, const scalar_t* __restrict__ weight, int hidden,
                                    int heads, long long token_stride, long long head_stride, float eps) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const scalar_t* in = x + (row / heads) * token_stride + (row % heads) * head_stride;
  const long long base = row * hidden;
  Pack values[ITEMS], weights[ITEMS], summed[ITEMS];
#pragma unroll
  for (int item = 0; item < ITEMS; ++item) {  // every load first, so they are all in flight at once
    const int i = (item * blockDim.x + threadIdx.x) * VEC;
    if (i < hidden) {
      values[item] = load_pack(in + i);
      weights[item] = load_pack(weight + i);
      if (residual != nullptr) summed[item] = load_pack(residual + base + i);
    }
  }
  if (residual != nullptr) {
#pragma unroll
    for (int item = 0; item < ITEMS; ++item) {
      const int i = (item * blockDim.x + threadIdx.x) * VEC;
      if (i < hidden) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          summed[item].v[e] = from_float(to_float(summed[item].v[e]) + to_float(values[item].v[e]));
        }
        store_pack(residual_out + base + i, summed[item]);
        values[item] = summed[item];
      }
    }
  }
  float sum_squares = 0.f;
#pragma unroll
  for (int item = 0; item < ITEMS; ++item) {
    if ((item * blockDim.x + threadIdx.x) * VEC < hidden) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum_squares += to_float(values[item].v[e]) * to_float(values[item].v[e]);
    }
  }
  const float scale = rsqrtf(block_sum(sum_squares, scratch) / hidden + eps);
#pragma unroll
  for (int item = 0; item < ITEMS; ++item) {
    const int i = (item * blockDim.x + threadIdx.x) * VEC;
    if (i < hidden) {
      Pack normed;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float rounded = to_float(from_float(to_float(values[item].v[e]) * scale));
        normed.v[e] = from_float(to_float(weights[item].v[e]) * rounded);
      }
      store_pack(out + base + i, normed);
    }
  }
}
