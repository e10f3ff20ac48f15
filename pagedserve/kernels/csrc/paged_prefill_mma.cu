// Paged prefill attention on tensor cores (FlashAttention-2 over the paged cache), for 16-bit types.
//
// A block takes one tile of query rows of one sequence and one KV head: ROWS rows, each a (query token, query
// head of the KV head's GQA group) pair, so that the group's heads share every K and V tile. Each warp holds
// 16 rows: their Q fragments, their output and their online softmax stay in registers. K and V come in
// tiles of BLOCK_N keys gathered from the pages by cp.async into shared memory, two stages deep, so the next
// tile loads while this one is multiplied. S = Q K^T and O += P V are mma.m16n8k16 with fragments from
// ldmatrix; keys past a row's position (or before its window) are masked, and tiles past the tile's last
// position (or wholly before its first one's window) never load.
//
// Compile-time: HEAD_DIM (D, 64 or 128), PAGE_SIZE (B), GROUP, NUM_WARPS (ROWS = 16 NUM_WARPS).
//   q:             [Tp, Hq, D], token stride q_stride; out: [Tp, Hq, D] contiguous
//   tiles:         [tiles, 4]: block_tables row, first query token (an index of q), tokens, first position
//   kv:            [2, P, B, Hkv, D] contiguous; V starts v_offset elements after K
//   window, softcap, sinks ([Hq] or null): the layer's variations (variations.cuh)
// grid: (tiles, Hkv); block: NUM_WARPS * 32.

#define ROWS (16 * NUM_WARPS)
#define TILE_TOKENS (ROWS / GROUP)  // query tokens a tile holds; rows past TILE_TOKENS * GROUP are idle
#define BLOCK_N 32
#define CHUNKS (HEAD_DIM / 8)  // 16-byte chunks of a row

// Where element chunk * 8 of a row lies in a [rows, D] tile: the chunk index XOR the row's low three bits,
// so that the eight rows one ldmatrix phase reads fall in eight different banks.
__device__ __forceinline__ int swizzled(int row, int chunk) { return row * HEAD_DIM + ((chunk ^ (row % 8)) * 8); }

struct alignas(128) KvTiles {
  scalar_t tile[2][2][BLOCK_N * HEAD_DIM];  // by stage, then K and V: a stage is one span of 2 BLOCK_N rows
};

// Starts the copy of keys first..first + BLOCK_N - 1 into stage; keys before low (the window's) or from kv_len
// on are zeros, so that a masked key's V, whatever its page holds now, adds nothing.
__device__ __forceinline__ void load_kv(KvTiles& tiles, int stage, const scalar_t* kv, const long long* table,
                                        int first, int low, int kv_len, int num_kv_heads, int kv_head,
                                        long long v_offset) {
  for (int c = threadIdx.x; c < BLOCK_N * CHUNKS; c += blockDim.x) {
    const int row = c / CHUNKS, chunk = c % CHUNKS, key = first + row;
    const bool valid = key >= low && key < kv_len;
    const long long page = valid ? table[key / PAGE_SIZE] : 0;
    const long long at = ((page * PAGE_SIZE + key % PAGE_SIZE) * num_kv_heads + kv_head) * HEAD_DIM + chunk * 8;
    cp_async_16(&tiles.tile[stage][0][swizzled(row, chunk)], kv + at, valid);
    cp_async_16(&tiles.tile[stage][1][swizzled(row, chunk)], kv + v_offset + at, valid);
  }
}

extern "C" __global__ void paged_prefill_mma(scalar_t* __restrict__ out, const scalar_t* __restrict__ q,
                                             const scalar_t* __restrict__ kv,
                                             const long long* __restrict__ block_tables,
                                             const long long* __restrict__ tiles, int num_kv_heads, int max_pages,
                                             long long q_stride, long long v_offset, float scale, int window,
                                             float softcap, const scalar_t* __restrict__ sinks) {
  static_assert(ROWS * HEAD_DIM <= 2 * BLOCK_N * HEAD_DIM, "the Q tile is staged in the K/V tiles' stage 1");
  __shared__ KvTiles kv_tiles;
  const int kv_head = blockIdx.y;
  const long long* tile = tiles + 4 * (long long)blockIdx.x;
  const long long* table = block_tables + tile[0] * max_pages;
  const long long q_first = tile[1];
  const int tokens = (int)tile[2], first_pos = (int)tile[3];
  const int kv_len = first_pos + tokens;  // the keys the tile's last token attends to
  const int first_key = window_start(first_pos, window);  // the first the tile's first token sees
  const int first_tile = first_key / BLOCK_N;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int group = lane / 4, pair = 2 * (lane % 4);

  // Q rows into stage 1 (free until the loop), then into registers as A fragments.
  scalar_t* q_tile = kv_tiles.tile[1][0];
  for (int c = threadIdx.x; c < ROWS * CHUNKS; c += blockDim.x) {
    const int row = c / CHUNKS, chunk = c % CHUNKS, t = row / GROUP, g = row % GROUP;
    const bool valid = row < TILE_TOKENS * GROUP && t < tokens;
    const scalar_t* source = q + (q_first + (valid ? t : 0)) * q_stride + (kv_head * GROUP + g) * HEAD_DIM;
    cp_async_16(&q_tile[swizzled(row, chunk)], source + chunk * 8, valid);
  }
  cp_async_commit();
  load_kv(kv_tiles, 0, kv, table, first_tile * BLOCK_N, first_key, kv_len, num_kv_heads, kv_head, v_offset);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  unsigned q_frag[HEAD_DIM / 16][4];
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
    ldmatrix_x4(q_frag[ks], &q_tile[swizzled(warp * 16 + lane % 16, 2 * ks + lane / 16)]);
  }
  __syncthreads();  // stage 1 is the pipeline's from here

  // This lane's rows: group and group + 8 of the warp's 16; their first and last visible keys.
  int low[2], limit[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp * 16 + group + 8 * half;
    limit[half] = row < TILE_TOKENS * GROUP ? first_pos + row / GROUP : -1;
    low[half] = window_start(limit[half], window);
  }
  float o[HEAD_DIM / 8][4] = {};
  float row_max[2] = {NEG_LARGE, NEG_LARGE}, row_sum[2] = {0.f, 0.f};
  const int n_tiles = (kv_len + BLOCK_N - 1) / BLOCK_N;
  for (int n = first_tile; n < n_tiles; ++n) {
    const int stage = (n - first_tile) % 2;
    if (n + 1 < n_tiles) {
      load_kv(kv_tiles, stage ^ 1, kv, table, (n + 1) * BLOCK_N, first_key, kv_len, num_kv_heads, kv_head, v_offset);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    float s[BLOCK_N / 8][4] = {};
    const scalar_t* k_tile = kv_tiles.tile[stage][0];
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < BLOCK_N / 16; ++np) {
        unsigned b[4];
        ldmatrix_x4(b, &k_tile[swizzled(np * 16 + (lane / 16) * 8 + lane % 8, 2 * ks + (lane / 8) % 2)]);
        mma_16816(s[2 * np], q_frag[ks], b[0], b[1]);
        mma_16816(s[2 * np + 1], q_frag[ks], b[2], b[3]);
      }
    }

    // The online softmax, rescaled once per tile.
#pragma unroll
    for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = n * BLOCK_N + nt * 8 + pair + i % 2;
        const bool visible = key >= low[i / 2] && key <= limit[i / 2];
        s[nt][i] = visible ? capped(s[nt][i] * scale, softcap) * LOG2E : NEG_LARGE;  // exp(x) = exp2(x log2 e)
      }
    }
    float rescale[2];
    softmax_tile(s, row_max, row_sum, rescale);
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[dt][i] *= rescale[i / 2];
    }

    // O += P V: P's C fragments are A fragments once packed (keys 16 kk..16 kk + 15 are n-tiles 2 kk, 2 kk + 1).
    const scalar_t* v_tile = kv_tiles.tile[stage][1];
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      const unsigned p[4] = {pack_pair(s[2 * kk][0], s[2 * kk][1]), pack_pair(s[2 * kk][2], s[2 * kk][3]),
                             pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        unsigned b[4];
        ldmatrix_x4_trans(b, &v_tile[swizzled(kk * 16 + ((lane / 8) % 2) * 8 + lane % 8, 2 * dp + lane / 16)]);
        mma_16816(o[2 * dp], p, b[0], b[1]);
        mma_16816(o[2 * dp + 1], p, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
    const int row = warp * 16 + group + 8 * half, t = row / GROUP, g = row % GROUP;
    if (limit[half] < 0 || t >= tokens) continue;
    scalar_t* out_row = out + ((q_first + t) * num_kv_heads * GROUP + kv_head * GROUP + g) * HEAD_DIM;
    float rescale;
    const float denominator = with_sink(row_sum[half], row_max[half] * LN2, sinks, kv_head * GROUP + g, rescale);
    const float factor = rescale / denominator;
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
      store_pair(out_row + dt * 8 + pair, pack_pair(o[dt][2 * half] * factor, o[dt][2 * half + 1] * factor));
    }
  }
}
