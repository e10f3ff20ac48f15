// Shared by the paged attention kernels: the GROUP query heads that share one KV head, held by one warp.
// Each lane keeps HEAD_DIM / 32 elements of every head's query and running output, so that the warp reads
// each K and V row once, coalesced, for all of them. Every loop over GROUP and PER_LANE is unrolled, which
// keeps the arrays in registers.

#define PER_LANE (HEAD_DIM / WARP_SIZE)

struct GroupAttention {
  float query[GROUP][PER_LANE];
  float acc[GROUP][PER_LANE];
  float max[GROUP];
  float sum[GROUP];
  float softcap;

  // q_row points at the first query head of the group; the heads are HEAD_DIM apart.
  __device__ __forceinline__ void start(const scalar_t* q_row, float scale, float softcap_, int lane) {
    softcap = softcap_;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int e = 0; e < PER_LANE; ++e) {
        query[g][e] = to_float(q_row[g * HEAD_DIM + lane * PER_LANE + e]) * scale;
        acc[g][e] = 0.f;
      }
      max[g] = NEG_LARGE;
      sum[g] = 0.f;
    }
  }

  // Folds one key and value row (this lane's elements start at kv + at) into every head's online softmax.
  __device__ __forceinline__ void attend(const scalar_t* kv, long long at, long long v_offset) {
    float key[PER_LANE], value[PER_LANE];
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
      key[e] = to_float(kv[at + e]);
      value[e] = to_float(kv[v_offset + at + e]);
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < PER_LANE; ++e) dot += query[g][e] * key[e];
      dot = capped(warp_sum(dot), softcap);
      const float new_max = fmaxf(max[g], dot);
      const float rescale = __expf(max[g] - new_max), weight = __expf(dot - new_max);
      sum[g] = sum[g] * rescale + weight;
#pragma unroll
      for (int e = 0; e < PER_LANE; ++e) acc[g][e] = acc[g][e] * rescale + weight * value[e];
      max[g] = new_max;
    }
  }

  // Head g's output element e of this lane, sinks (null, or one logit a query head) in the denominator.
  __device__ __forceinline__ float output(int g, int e, const scalar_t* sinks, int head) const {
    float rescale;
    const float denominator = with_sink(sum[g], max[g], sinks, head, rescale);
    return acc[g][e] * rescale / denominator;
  }
};

// Where token t of a sequence lives: this lane's first element of its row for kv_head, K half of the pool.
__device__ __forceinline__ long long kv_row(const long long* table, int t, int num_kv_heads, int kv_head, int lane) {
  const long long page = table[t / PAGE_SIZE];
  return ((page * PAGE_SIZE + t % PAGE_SIZE) * num_kv_heads + kv_head) * HEAD_DIM + lane * PER_LANE;
}
