// Rotary embedding, half-split ("neox") as in transformers, in place on q and k.
//   q: [T, Hq, D], token stride q_stride; k: [T, Hkv, D], token stride k_stride; heads D apart
//   positions: [T]; cos_sin: [max_positions, 2, D], cos then sin of each position
// out[j] = x[j] cos[j] - x[j + D/2] sin[j];  out[j + D/2] = x[j + D/2] cos[j + D/2] + x[j] sin[j + D/2]
// grid: (T); block: up to (Hq + Hkv) * D / 2 threads.

extern "C" __global__ void rotary(scalar_t* __restrict__ q, scalar_t* __restrict__ k,
                                  const long long* __restrict__ positions, const scalar_t* __restrict__ cos_sin,
                                  int q_heads, int k_heads, int head_dim, long long q_stride, long long k_stride) {
  const long long token = blockIdx.x;
  const scalar_t* cos = cos_sin + positions[token] * 2 * head_dim;
  const scalar_t* sin = cos + head_dim;
  const int half = head_dim / 2;
  const int pairs = (q_heads + k_heads) * half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int head = i / half, j = i % half;
    scalar_t* x = head < q_heads ? q + token * q_stride + head * head_dim
                                 : k + token * k_stride + (head - q_heads) * head_dim;
    const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
    x[j] = from_float(x1 * to_float(cos[j]) - x2 * to_float(sin[j]));
    x[j + half] = from_float(x2 * to_float(cos[j + half]) + x1 * to_float(sin[j + half]));
  }
}
