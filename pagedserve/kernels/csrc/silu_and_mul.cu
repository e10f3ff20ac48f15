// The gated MLP's activation: out = silu(gate) * up, where x = [gate | up].
//   x: [T, 2 I], token stride x_stride; out: [T, I] contiguous
// Compile-time: VEC. grid: (T); block: up to I / VEC threads.

extern "C" __global__ void silu_and_mul(scalar_t* __restrict__ out, const scalar_t* __restrict__ x, int inner,
                                        long long x_stride) {
  const long long token = blockIdx.x;
  const scalar_t* row = x + token * x_stride;
  for (int i = threadIdx.x * VEC; i < inner; i += blockDim.x * VEC) {
    const Pack gate = load_pack(row + i), up = load_pack(row + inner + i);
    Pack product;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float g = to_float(gate.v[e]);
      // The fast divide: where 1 + e^-g passes 2^126 it gives 0, which silu's true value rounds to anyway.
      const float silu = to_float(from_float(__fdividef(g, 1.f + __expf(-g))));  // torch rounds silu's output
      product.v[e] = from_float(silu * to_float(up.v[e]));
    }
    store_pack(out + token * inner + i, product);
  }
}
