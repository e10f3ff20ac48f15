// Paged prefill attention: each query token of a prefill chunk attends causally to its sequence's cached
// prefix and to the chunk up to itself, with an online softmax. The chunk's K and V are already in the pool.
//
// Compile-time: HEAD_DIM, PAGE_SIZE, GROUP, NUM_WARPS, as in paged_decode.
//   q:             [Tp, Hq, D], token stride q_stride; out: [Tp, Hq, D] contiguous
//   token_seq:     [Tp] the row of block_tables each query token belongs to
//   token_pos:     [Tp] its position in its sequence: it attends to keys 0..token_pos (its window's, if any)
//   window, softcap, sinks ([Hq] or null): the layer's variations (variations.cuh)
// grid: (ceil(Tp * Hkv / NUM_WARPS)); block: NUM_WARPS * 32. One warp per (query token, KV head), serving all
// GROUP query heads that share the KV head, so each K and V row is read once for them.

extern "C" __global__ void paged_prefill(scalar_t* __restrict__ out, const scalar_t* __restrict__ q,
                                         const scalar_t* __restrict__ kv, const long long* __restrict__ block_tables,
                                         const long long* __restrict__ token_seq,
                                         const long long* __restrict__ token_pos, int num_tokens, int num_kv_heads,
                                         int max_pages, long long q_stride, long long v_offset, float scale,
                                         int window, float softcap, const scalar_t* __restrict__ sinks) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const long long item = (long long)blockIdx.x * NUM_WARPS + warp;
  if (item >= (long long)num_tokens * num_kv_heads) return;
  const long long token = item / num_kv_heads;
  const int kv_head = (int)(item % num_kv_heads);
  const long long* table = block_tables + token_seq[token] * max_pages;
  const int pos = (int)token_pos[token];

  GroupAttention state;
  state.start(q + token * q_stride + kv_head * GROUP * HEAD_DIM, scale, softcap, lane);
  for (int t = window_start(pos, window); t <= pos; ++t) state.attend(kv, kv_row(table, t, num_kv_heads, kv_head, lane), v_offset);

#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    scalar_t* row = out + (token * num_kv_heads * GROUP + kv_head * GROUP + g) * HEAD_DIM + lane * PER_LANE;
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) row[e] = from_float(state.output(g, e, sinks, kv_head * GROUP + g));
  }
}
