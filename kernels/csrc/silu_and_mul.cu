// The gated MLP's activation: out = silu(gate) * up, where x = [gate | up].
//   x: [T, 2 I], token stride x_stride; out: [T, I] contiguous
// grid: (T); block: up to I threads.

extern "C" __global__ void silu_and_mul(scalar_t* __restrict__ out, const scalar_t* __restrict__ x, int inner,
                                        long long x_stride) {
  const long long token = blockIdx.x;
  const scalar_t* row = x + token * x_stride;
  for (int i = threadIdx.x; i < inner; i += blockDim.x) {
    const float gate = to_float(row[i]);
    const float silu = to_float(from_float(gate / (1.f + __expf(-gate))));  // torch rounds silu's output
    out[token * inner + i] = from_float(silu * to_float(row[inner + i]));
  }
}
