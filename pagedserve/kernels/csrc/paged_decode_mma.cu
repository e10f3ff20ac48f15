// Paged decode attention on tensor cores, for 16-bit types: one new query token per sequence, its GQA group's
// query heads as the rows of one m16 tile (padded to 16), against the sequence's cached K and V, split-K
// (FlashDecoding) as paged_decode.cu is, into the same partial outputs, merged by paged_decode_reduce.
//
// Decode only streams K and V, so what counts is the bytes in flight: each warp runs its own pipeline of
// STAGES tiles of 16 keys, gathered by cp.async (16 bytes a copy) into shared memory, with the page ids of
// the whole partition read once, up front, into shared memory. Each tile costs one softmax rescale: S = Q K^T
// and O += P V are mma.m16n8k16 from ldmatrix fragments. The warps' results merge through shared memory.
//
// Compile-time: HEAD_DIM (D), PAGE_SIZE (B), GROUP (<= 16), NUM_WARPS, MAX_PARTITION (tokens, a multiple of B).
// Arguments (the layer's window, softcap and sinks included) and outputs as paged_decode's. Dynamic shared memory: decode_mma_shared_bytes() below.
// grid: (S, Hkv, partitions); block: NUM_WARPS * 32.

#define KEYS 16  // a tile: the k of the P V product
#ifndef STAGES
#error "define STAGES, the tiles in flight per warp (Tuning.decode_stages)"
#endif
#define CHUNKS (HEAD_DIM / 8)  // 16-byte chunks of a row
#define MAX_PAGES (MAX_PARTITION / PAGE_SIZE)

__device__ __forceinline__ int swizzled(int row, int chunk) { return row * HEAD_DIM + ((chunk ^ (row % 8)) * 8); }

// The layout of the dynamic shared memory, in bytes from its start.
#define TILE_ELEMENTS (2 * KEYS * HEAD_DIM)  // K then V
#define PIPELINE_BYTES (NUM_WARPS * STAGES * TILE_ELEMENTS * 2)
#define Q_OFFSET PIPELINE_BYTES
#define PAGES_OFFSET (Q_OFFSET + 16 * HEAD_DIM * 2)
#define SHARED_BYTES (PAGES_OFFSET + MAX_PAGES * 4)

// Starts the copy of the warp's keys first..first + KEYS - 1 into its tile; those before low (the window's first)
// or from end on are zeros, so that a masked key's V, whatever its page holds now, adds nothing.
__device__ __forceinline__ void load_tile(scalar_t* tile, const scalar_t* kv, const int* pages, int start, int first,
                                         int low, int end, int num_kv_heads, int kv_head, long long v_offset,
                                         int lane) {
#pragma unroll
  for (int c = lane; c < KEYS * CHUNKS; c += WARP_SIZE) {
    const int row = c / CHUNKS, chunk = c % CHUNKS, key = first + row;
    const bool valid = key >= low && key < end;
    const long long page = valid ? pages[(key - start) / PAGE_SIZE] : 0;
    const long long at = ((page * PAGE_SIZE + key % PAGE_SIZE) * num_kv_heads + kv_head) * HEAD_DIM + chunk * 8;
    cp_async_16(&tile[swizzled(row, chunk)], kv + at, valid);
    cp_async_16(&tile[KEYS * HEAD_DIM + swizzled(row, chunk)], kv + v_offset + at, valid);
  }
}

extern "C" __global__ void paged_decode_mma(scalar_t* __restrict__ out, float* __restrict__ partial_out,
                                            float* __restrict__ partial_max, float* __restrict__ partial_sum,
                                            const scalar_t* __restrict__ q, const scalar_t* __restrict__ kv,
                                            const long long* __restrict__ block_tables,
                                            const long long* __restrict__ seq_lens, int num_kv_heads, int max_pages,
                                            long long q_stride, long long v_offset, float scale, int partition_size,
                                            int window, float softcap, const scalar_t* __restrict__ sinks) {
  static_assert(STAGES >= 2, "a pipeline needs a tile in flight beside the one in use");
  static_assert(NUM_WARPS * GROUP * (HEAD_DIM + 2) * 4 <= PIPELINE_BYTES, "the warps merge in the pipeline's space");
  DYNAMIC_SHARED(shared);
  scalar_t* pipeline = reinterpret_cast<scalar_t*>(shared);
  scalar_t* q_tile = reinterpret_cast<scalar_t*>(shared + Q_OFFSET);
  int* pages = reinterpret_cast<int*>(shared + PAGES_OFFSET);

  DecodePartition p;
  if (!decode_partition(p, seq_lens, num_kv_heads, partition_size, window, partial_max, partial_sum)) return;
  const int seq = p.seq, kv_head = p.kv_head, start = p.start, end = p.end, partitions = gridDim.z;
  const int first_visible = p.first;
  const long long partial = p.partial;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int group = lane / 4, pair = 2 * (lane % 4);

  // The partition's page ids and the group's query rows, once for the block.
  const long long* table = block_tables + (long long)seq * max_pages + start / PAGE_SIZE;
  for (int i = threadIdx.x; i < (end - start + PAGE_SIZE - 1) / PAGE_SIZE; i += blockDim.x) pages[i] = (int)table[i];
  const scalar_t* q_row = q + seq * q_stride + kv_head * GROUP * HEAD_DIM;
  for (int c = threadIdx.x; c < 16 * CHUNKS; c += blockDim.x) {
    const int row = c / CHUNKS, chunk = c % CHUNKS;
    cp_async_16(&q_tile[swizzled(row, chunk)], q_row + (row < GROUP ? row : 0) * HEAD_DIM + chunk * 8, row < GROUP);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  unsigned q_frag[HEAD_DIM / 16][4];
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks) ldmatrix_x4(q_frag[ks], &q_tile[swizzled(lane % 16, 2 * ks + lane / 16)]);

  // This warp's tiles: every NUM_WARPS-th one of the partition, STAGES - 1 in flight ahead of the one in use.
  scalar_t* tiles = pipeline + warp * STAGES * TILE_ELEMENTS;
  const int count = ((end - start + KEYS - 1) / KEYS - warp + NUM_WARPS - 1) / NUM_WARPS;
  const auto first_key = [&](int j) { return start + (warp + j * NUM_WARPS) * KEYS; };
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    if (j < count) load_tile(tiles + j * TILE_ELEMENTS, kv, pages, start, first_key(j), first_visible, end, num_kv_heads, kv_head, v_offset, lane);
    cp_async_commit();
  }
  float o[HEAD_DIM / 8][4] = {};
  float row_max[2] = {NEG_LARGE, NEG_LARGE}, row_sum[2] = {0.f, 0.f};
  for (int j = 0; j < count; ++j) {
    const int ahead = j + STAGES - 1;
    if (ahead < count) {
      load_tile(tiles + (ahead % STAGES) * TILE_ELEMENTS, kv, pages, start, first_key(ahead), first_visible, end,
                num_kv_heads, kv_head, v_offset, lane);
    }
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    const scalar_t* k_tile = tiles + (j % STAGES) * TILE_ELEMENTS;
    const scalar_t* v_tile = k_tile + KEYS * HEAD_DIM;

    float s[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned b[4];
      ldmatrix_x4(b, &k_tile[swizzled((lane / 16) * 8 + lane % 8, 2 * ks + (lane / 8) % 2)]);
      mma_16816(s[0], q_frag[ks], b[0], b[1]);
      mma_16816(s[1], q_frag[ks], b[2], b[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = first_key(j) + nt * 8 + pair + i % 2;
        s[nt][i] = key >= first_visible && key < end ? capped(s[nt][i] * scale, softcap) * LOG2E : NEG_LARGE;
      }
    }
    float rescale[2];
    softmax_tile(s, row_max, row_sum, rescale);
    const unsigned p[4] = {pack_pair(s[0][0], s[0][1]), pack_pair(s[0][2], s[0][3]), pack_pair(s[1][0], s[1][1]),
                           pack_pair(s[1][2], s[1][3])};
#pragma unroll
    for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
      unsigned b[4];
      ldmatrix_x4_trans(b, &v_tile[swizzled(((lane / 8) % 2) * 8 + lane % 8, 2 * dp + lane / 16)]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        o[2 * dp][i] *= rescale[i / 2];
        o[2 * dp + 1][i] *= rescale[i / 2];
      }
      mma_16816(o[2 * dp], p, b[0], b[1]);
      mma_16816(o[2 * dp + 1], p, b[2], b[3]);
    }
    __syncwarp();  // the warp is done with this stage before a later iteration refills it
  }
  cp_async_wait<0>();

  // Merge the warps: each puts its rows' max, sum and output in shared memory (the pipeline's, now free).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
  }
  __syncthreads();
  float* warp_acc = reinterpret_cast<float*>(shared);  // [NUM_WARPS][GROUP][HEAD_DIM]
  float* warp_max = warp_acc + NUM_WARPS * GROUP * HEAD_DIM;  // [NUM_WARPS][GROUP]
  float* warp_sum_ = warp_max + NUM_WARPS * GROUP;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int g = group + 8 * half;
    if (g >= GROUP) continue;
    if (pair == 0) {
      warp_max[warp * GROUP + g] = row_max[half];
      warp_sum_[warp * GROUP + g] = row_sum[half];
    }
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
      warp_acc[(warp * GROUP + g) * HEAD_DIM + dt * 8 + pair] = o[dt][2 * half];
      warp_acc[(warp * GROUP + g) * HEAD_DIM + dt * 8 + pair + 1] = o[dt][2 * half + 1];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float block_max = NEG_LARGE;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) block_max = fmaxf(block_max, warp_max[w * GROUP + g]);
    float total = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float rescale = exp2f(warp_max[w * GROUP + g] - block_max);
      total += warp_acc[(w * GROUP + g) * HEAD_DIM + d] * rescale;
      sum += warp_sum_[w * GROUP + g] * rescale;
    }
    if (partitions == 1) {
      float rescale;
      const float denominator = with_sink(sum, block_max * LN2, sinks, kv_head * GROUP + g, rescale);
      out[((long long)seq * num_kv_heads * GROUP + kv_head * GROUP + g) * HEAD_DIM + d] =
          from_float(total * rescale / denominator);
    } else {
      // paged_decode_reduce takes maxima in natural-log units, as paged_decode writes them.
      partial_out[(partial + g) * HEAD_DIM + d] = total;
      if (d == 0) {
        partial_max[partial + g] = block_max * LN2;
        partial_sum[partial + g] = sum;
      }
    }
  }
}
