// Rotary embedding, half-split ("neox") as in transformers, in place on q and k.
//   q: [T, Hq, D], token stride q_stride; k: [T, Hkv, D], token stride k_stride; heads D apart
//   positions: [T]; cos_sin: [max_positions, 2, D], cos then sin of each position
// out[j] = x[j] cos[j] - x[j + D/2] sin[j];  out[j + D/2] = x[j + D/2] cos[j + D/2] + x[j] sin[j + D/2]
// Compile-time: HEAD_DIM (D), so that a thread's head and column come from shifts, and VEC.
// grid: (T); block: up to (Hq + Hkv) * D / (2 VEC) threads, each rotating VEC pairs at a time.

#define HALF (HEAD_DIM / 2)
#define CHUNKS (HALF / VEC)  // packs of VEC pairs per head

extern "C" __global__ void rotary(scalar_t* __restrict__ q, scalar_t* __restrict__ k,
                                  const long long* __restrict__ positions, const scalar_t* __restrict__ cos_sin,
                                  int q_heads, int k_heads, long long q_stride, long long k_stride) {
  const long long token = blockIdx.x;
  const scalar_t* cos = cos_sin + positions[token] * 2 * HEAD_DIM;
  const scalar_t* sin = cos + HEAD_DIM;
  const int packs = (q_heads + k_heads) * CHUNKS;
  for (int i = threadIdx.x; i < packs; i += blockDim.x) {
    const int head = i / CHUNKS, j = (i % CHUNKS) * VEC;
    scalar_t* x = head < q_heads ? q + token * q_stride + head * HEAD_DIM
                                 : k + token * k_stride + (head - q_heads) * HEAD_DIM;
    const Pack x1 = load_pack(x + j), x2 = load_pack(x + j + HALF);
    const Pack cos1 = load_pack(cos + j), cos2 = load_pack(cos + j + HALF);
    const Pack sin1 = load_pack(sin + j), sin2 = load_pack(sin + j + HALF);
    Pack out1, out2;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float a = to_float(x1.v[e]), b = to_float(x2.v[e]);
      out1.v[e] = from_float(a * to_float(cos1.v[e]) - b * to_float(sin1.v[e]));
      out2.v[e] = from_float(b * to_float(cos2.v[e]) + a * to_float(sin2.v[e]));
    }
    store_pack(x + j, out1);
    store_pack(x + j + HALF, out2);
  }
}
