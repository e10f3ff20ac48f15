// Shared by both paged decode kernels: which part of which sequence's context a block reduces (split-K).
// grid: (S, Hkv, partitions); partition p covers tokens [base + p partition_size, base + (p + 1) partition_size),
// where base is 0, or with a window the start of the page that holds the window's first key: partitions stay
// whole pages, and nothing before the window's page is read.

// The first token the partitions of a sequence of len tokens (the new one included) start from.
__device__ __forceinline__ int decode_base(int len, int window) {
  return window_start(len - 1, window) / PAGE_SIZE * PAGE_SIZE;
}

struct DecodePartition {
  int seq, kv_head, start, end;  // the tokens [start, end) of sequence seq, for KV head kv_head
  int first;                     // the first key the new token sees (its window's): keys before it are masked
  long long partial;             // this partition's first row in partial_max and partial_sum ([..., GROUP])
};

// This block's partition; false when it lies past the sequence's end, having marked it empty, with a sum of
// 0, for paged_decode_reduce (the whole block returns then).
__device__ __forceinline__ bool decode_partition(DecodePartition& p, const long long* seq_lens, int num_kv_heads,
                                                 int partition_size, int window, float* partial_max,
                                                 float* partial_sum) {
  p.seq = blockIdx.x;
  p.kv_head = blockIdx.y;
  const int len = (int)seq_lens[p.seq];
  p.first = window_start(len - 1, window);
  p.start = decode_base(len, window) + blockIdx.z * partition_size;
  p.end = min(p.start + partition_size, len);
  p.partial = ((long long)(p.seq * num_kv_heads + p.kv_head) * gridDim.z + blockIdx.z) * GROUP;
  if (p.start < len) return true;
  if (threadIdx.x < GROUP) {
    partial_max[p.partial + threadIdx.x] = NEG_LARGE;
    partial_sum[p.partial + threadIdx.x] = 0.f;
  }
  return false;
}
