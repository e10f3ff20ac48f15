// Paged decode attention: one new query token per sequence against all of its cached K and V, with
// GQA and split-K (FlashDecoding): a sequence's context is cut into partitions that separate blocks
// reduce in parallel, each with an online softmax, and paged_decode_reduce merges them.
//
// Compile-time: HEAD_DIM (D, 64 or 128), PAGE_SIZE (B), GROUP (query heads per KV head), NUM_WARPS.
//   q:             [S, Hq, D], token stride q_stride; Hq = Hkv * GROUP, heads D apart
//   kv:            [2, P, B, Hkv, D] contiguous; V starts v_offset elements after K
//   block_tables:  [S, max_pages]; seq_lens: [S], tokens in the cache, the new one included
//   out:           [S, Hq, D] contiguous: written here when there is one partition
//   partial_*:     [S, Hkv, partitions, GROUP (, D)]: written when there are several
//   window, softcap, sinks ([Hq] or null): the layer's variations (variations.cuh)
// grid: (S, Hkv, partitions); block: NUM_WARPS * 32 threads. Each warp takes every NUM_WARPS-th token of
// the partition; each lane holds D / 32 elements of every row it reads, so a warp reads a row coalesced.

extern "C" __global__ void paged_decode(scalar_t* __restrict__ out, float* __restrict__ partial_out,
                                        float* __restrict__ partial_max, float* __restrict__ partial_sum,
                                        const scalar_t* __restrict__ q, const scalar_t* __restrict__ kv,
                                        const long long* __restrict__ block_tables,
                                        const long long* __restrict__ seq_lens, int num_kv_heads, int max_pages,
                                        long long q_stride, long long v_offset, float scale, int partition_size,
                                        int window, float softcap, const scalar_t* __restrict__ sinks) {
  __shared__ float warp_max[NUM_WARPS][GROUP];
  __shared__ float warp_sum_[NUM_WARPS][GROUP];
  __shared__ float warp_acc[NUM_WARPS][GROUP][HEAD_DIM];

  DecodePartition p;
  if (!decode_partition(p, seq_lens, num_kv_heads, partition_size, window, partial_max, partial_sum)) return;
  const int seq = p.seq, kv_head = p.kv_head, start = p.start, end = p.end, partitions = gridDim.z;
  const int first_visible = p.first;
  const long long partial = p.partial;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

  GroupAttention state;
  state.start(q + seq * q_stride + kv_head * GROUP * HEAD_DIM, scale, softcap, lane);
  const long long* table = block_tables + (long long)seq * max_pages;
  for (int t = max(start, first_visible) + warp; t < end; t += NUM_WARPS) {
    state.attend(kv, kv_row(table, t, num_kv_heads, kv_head, lane), v_offset);
  }

#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (lane == 0) {
      warp_max[warp][g] = state.max[g];
      warp_sum_[warp][g] = state.sum[g];
    }
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) warp_acc[warp][g][lane * PER_LANE + e] = state.acc[g][e];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float block_max = NEG_LARGE;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) block_max = fmaxf(block_max, warp_max[w][g]);
    float total = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float rescale = __expf(warp_max[w][g] - block_max);
      total += warp_acc[w][g][d] * rescale;
      sum += warp_sum_[w][g] * rescale;
    }
    if (partitions == 1) {
      float rescale;
      const float denominator = with_sink(sum, block_max, sinks, kv_head * GROUP + g, rescale);
      out[((long long)seq * num_kv_heads * GROUP + kv_head * GROUP + g) * HEAD_DIM + d] =
          from_float(total * rescale / denominator);
    } else {
      partial_out[(partial + g) * HEAD_DIM + d] = total;
      if (d == 0) {
        partial_max[partial + g] = block_max;
        partial_sum[partial + g] = sum;
      }
    }
  }
}

// Merges the partitions of paged_decode. grid: (S, Hq); block: HEAD_DIM threads.
extern "C" __global__ void paged_decode_reduce(scalar_t* __restrict__ out, const float* __restrict__ partial_out,
                                               const float* __restrict__ partial_max,
                                               const float* __restrict__ partial_sum,
                                               const long long* __restrict__ seq_lens, int num_kv_heads,
                                               int partitions, int partition_size, int window,
                                               const scalar_t* __restrict__ sinks) {
  const int seq = blockIdx.x, q_head = blockIdx.y;
  const int kv_head = q_head / GROUP, g = q_head % GROUP;
  const int len = (int)seq_lens[seq];
  const int used = (len - decode_base(len, window) + partition_size - 1) / partition_size;
  const long long first = (long long)(seq * num_kv_heads + kv_head) * partitions * GROUP + g;
  float overall_max = NEG_LARGE;
  for (int p = 0; p < used; ++p) overall_max = fmaxf(overall_max, partial_max[first + p * GROUP]);
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float total = 0.f, sum = 0.f;
    for (int p = 0; p < used; ++p) {
      const float rescale = __expf(partial_max[first + p * GROUP] - overall_max);
      total += partial_out[(first + p * GROUP) * HEAD_DIM + d] * rescale;
      sum += partial_sum[first + p * GROUP] * rescale;
    }
    float rescale;
    const float denominator = with_sink(sum, overall_max, sinks, q_head, rescale);
    out[((long long)seq * gridDim.y + q_head) * HEAD_DIM + d] = from_float(total * rescale / denominator);
  }
}
