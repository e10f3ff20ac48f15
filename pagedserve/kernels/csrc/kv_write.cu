// The KV write: each new token's K and V go into its page slot in one layer of the pool.
//   k, v:          [T, Hkv, D], token strides k_stride and v_stride (heads and dims contiguous)
//   kv:            [2, P, B, Hkv, D] contiguous; V starts v_offset elements after K
//   slot_mapping:  [T] page * B + offset; a negative slot is padding and is skipped
// Compile-time: VEC. grid: (T); block: up to Hkv * D / VEC threads.

extern "C" __global__ void kv_write(const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                                    scalar_t* __restrict__ kv, const long long* __restrict__ slot_mapping,
                                    long long k_stride, long long v_stride, int row, long long v_offset) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  for (int i = threadIdx.x * VEC; i < row; i += blockDim.x * VEC) {
    const long long dst = slot * row + i;
    const Pack key = load_pack(k + token * k_stride + i), value = load_pack(v + token * v_stride + i);
    store_pack(kv + dst, key);
    store_pack(kv + v_offset + dst, value);
  }
}
