// A mixture of experts' gated MLPs as two grouped GEMMs over the (token, slot) pairs, pair = token * top_k +
// slot, P = T * top_k of them, grouped by expert into row tiles (pagedserve/kernels/cuda_experts.py sorts them on the
// device, each expert's group padded to whole tiles of BLOCK_M rows):
//   moe_gate_up: act[pair] = gated(x[token] gate_up[e]^T + gate_up_bias[e])         act [P, I]
//   moe_down:    out[pair] = (act[pair] down[e]^T + down_bias[e]) * weights[pair]   out [P, H]
// and the caller sums each token's top_k rows of out, in a fixed order (no float atomics).
//
// Both grids are (row tiles, column tiles), the row tiles an upper bound of what any routing needs, so that
// nothing waits on the routing on the host (the launch can be captured in a CUDA graph); a tile past the
// last expert's group returns at once. A block computes one BLOCK_M x BLOCK_N tile of its expert's product,
// BLOCK_K of the depth at a time through shared memory, in fp32. A thread holds THREAD_M x THREAD_N of the
// tile in registers, its rows and columns strided across the tile, so that a warp's shared-memory reads and
// its global writes fall on consecutive columns.
//   sorted_pairs: [tiles * BLOCK_M] int64, each row tile's pairs; num_pairs (out of range) where padded
//   tile_expert:  [tiles] int64, each row tile's expert; num_experts past the last group
// Compile-time: BLOCK_M, BLOCK_N, BLOCK_K, THREAD_M, THREAD_N (dividing BLOCK_M and BLOCK_N).
// grid: (tiles, column tiles of I or H); block: (BLOCK_M / THREAD_M) * (BLOCK_N / THREAD_N) threads.

#if !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(BLOCK_K) || !defined(THREAD_M) || !defined(THREAD_N)
#error "define the tiles: BLOCK_M, BLOCK_N, BLOCK_K, THREAD_M, THREAD_N"
#endif

constexpr int ROW_THREADS = BLOCK_M / THREAD_M;  // threads down a tile's rows
constexpr int COL_THREADS = BLOCK_N / THREAD_N;  // threads across its columns
constexpr int THREADS = ROW_THREADS * COL_THREADS;

// A thread's rows of the tile are row0 + i * ROW_THREADS, its columns col0 + j * COL_THREADS.
__device__ __forceinline__ int row0() { return threadIdx.x / COL_THREADS; }
__device__ __forceinline__ int col0() { return threadIdx.x % COL_THREADS; }

// x as the model dtype holds it: where torch_ref rounds an intermediate result, so does the epilogue.
__device__ __forceinline__ float rounded(float x) { return to_float(from_float(x)); }

// The row tile's pairs (-1 for padding) and the start of each one's row of A, null for padding. Returns the
// tile's expert, or -1 for a tile past the last group (the same for every thread of the block).
__device__ __forceinline__ long long tile_rows(long long* pairs, const scalar_t** rows,
                                               const long long* sorted_pairs, const long long* tile_expert,
                                               int num_pairs, int num_experts, const scalar_t* a, int divisor,
                                               long long a_stride) {
  const long long expert = tile_expert[blockIdx.x];
  if (expert < 0 || expert >= num_experts) return -1;
  for (int i = threadIdx.x; i < BLOCK_M; i += THREADS) {
    const long long pair = sorted_pairs[(long long)blockIdx.x * BLOCK_M + i];
    const bool real = pair >= 0 && pair < num_pairs;
    pairs[i] = real ? pair : -1;
    rows[i] = real ? a + pair / divisor * a_stride : nullptr;
  }
  __syncthreads();
  return expert;
}

// acc[part][i][j] = sum over the depth of A[row i] . B[part][column j], for the thread's rows and columns:
// A's rows start at rows[] (null: a padding row, read as zeros), B[part]'s at b + part * part_stride +
// column * depth, and `columns` of the tile's columns exist (a last column tile has fewer where BLOCK_N does
// not divide the width).
template <int PARTS>
__device__ __forceinline__ void multiply(float (&acc)[PARTS][THREAD_M][THREAD_N], const scalar_t* const* rows,
                                         const scalar_t* b, long long part_stride, int columns, int depth) {
  // Stored [k][row], so that a step of the product reads along a row of each; the +1 puts the transposing
  // stores of consecutive k on different banks.
  __shared__ float a_tile[BLOCK_K][BLOCK_M + 1];
  __shared__ float b_tile[PARTS][BLOCK_K][BLOCK_N + 1];
#pragma unroll
  for (int part = 0; part < PARTS; ++part)
#pragma unroll
    for (int i = 0; i < THREAD_M; ++i)
#pragma unroll
      for (int j = 0; j < THREAD_N; ++j) acc[part][i][j] = 0.f;
  for (int k0 = 0; k0 < depth; k0 += BLOCK_K) {
    // Consecutive threads load consecutive k of a row: coalesced reads. Past the depth or the columns, zeros:
    // they add nothing, so the product needs no bounds checks, and no load reads past the weights' end.
    for (int e = threadIdx.x; e < BLOCK_M * BLOCK_K; e += THREADS) {
      const int row = e / BLOCK_K, k = e % BLOCK_K;
      a_tile[k][row] = rows[row] != nullptr && k0 + k < depth ? to_float(rows[row][k0 + k]) : 0.f;
    }
    for (int e = threadIdx.x; e < PARTS * BLOCK_N * BLOCK_K; e += THREADS) {
      const int part = e / (BLOCK_N * BLOCK_K), column = e / BLOCK_K % BLOCK_N, k = e % BLOCK_K;
      const bool inside = column < columns && k0 + k < depth;
      const long long at = part * part_stride + (long long)column * depth + k0 + k;
      b_tile[part][k][column] = inside ? to_float(b[at]) : 0.f;
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < BLOCK_K; ++k) {
      float a[THREAD_M];
#pragma unroll
      for (int i = 0; i < THREAD_M; ++i) a[i] = a_tile[k][row0() + i * ROW_THREADS];
#pragma unroll
      for (int part = 0; part < PARTS; ++part)
#pragma unroll
        for (int j = 0; j < THREAD_N; ++j) {
          const float w = b_tile[part][k][col0() + j * COL_THREADS];
#pragma unroll
          for (int i = 0; i < THREAD_M; ++i) acc[part][i][j] += a[i] * w;
        }
    }
    __syncthreads();  // every thread is done with the tiles before the next slice overwrites them
  }
}

// Calls store(i, j, pair, column) for each of the thread's outputs that exists: a real pair's, in a column
// below `limit` (I or H), column counted from the tile's first, n0.
template <class Store>
__device__ __forceinline__ void each_output(const long long* pairs, int n0, int limit, Store store) {
#pragma unroll
  for (int i = 0; i < THREAD_M; ++i) {
    const long long pair = pairs[row0() + i * ROW_THREADS];
    if (pair < 0) continue;
#pragma unroll
    for (int j = 0; j < THREAD_N; ++j) {
      const int column = n0 + col0() + j * COL_THREADS;
      if (column < limit) store(i, j, pair, column);
    }
  }
}

// torch_ref.gated of one gate and up value, each already rounded as F.linear leaves them, and rounded after
// each step where torch's ops in the model dtype round.
__device__ __forceinline__ float gated(float gate, float up, float limit, float alpha) {
  if (limit <= 0.f) return rounded(__fdividef(gate, 1.f + __expf(-gate))) * up;  // silu(gate) * up
  gate = fminf(gate, limit);  // gpt-oss: gate clamped above, up on both sides
  up = fminf(fmaxf(up, -limit), limit);
  const float sigmoid = rounded(__fdividef(1.f, 1.f + __expf(-rounded(gate * alpha))));
  return rounded(gate * sigmoid) * rounded(up + 1.f);
}

//   act: [P, I]; x: [T, H], token stride x_stride; gate_up: [E, 2 I, H]; gate_up_bias: [E, 2 I] or null
extern "C" __global__ void moe_gate_up(scalar_t* __restrict__ act, const scalar_t* __restrict__ x,
                                       const scalar_t* __restrict__ gate_up,
                                       const scalar_t* __restrict__ gate_up_bias,
                                       const long long* __restrict__ sorted_pairs,
                                       const long long* __restrict__ tile_expert, int num_pairs, int num_experts,
                                       int top_k, int hidden, int inner, long long x_stride, float swiglu_limit,
                                       float swiglu_alpha) {
  __shared__ long long pairs[BLOCK_M];
  __shared__ const scalar_t* rows[BLOCK_M];
  const long long expert =
      tile_rows(pairs, rows, sorted_pairs, tile_expert, num_pairs, num_experts, x, top_k, x_stride);
  if (expert < 0) return;
  const int n0 = blockIdx.y * BLOCK_N;
  // The tile's gate rows n0.. of gate_up[expert], and the matching up rows, I rows further on.
  const scalar_t* gate = gate_up + (expert * 2 * inner + n0) * hidden;
  float acc[2][THREAD_M][THREAD_N];
  multiply<2>(acc, rows, gate, (long long)inner * hidden, min(BLOCK_N, inner - n0), hidden);
  each_output(pairs, n0, inner, [&](int i, int j, long long pair, int column) {
    float g = acc[0][i][j], u = acc[1][i][j];
    if (gate_up_bias != nullptr) {
      g += to_float(gate_up_bias[expert * 2 * inner + column]);
      u += to_float(gate_up_bias[expert * 2 * inner + inner + column]);
    }
    act[pair * inner + column] = from_float(gated(rounded(g), rounded(u), swiglu_limit, swiglu_alpha));
  });
}

//   out: [P, H]; act: [P, I]; down: [E, H, I]; down_bias: [E, H] or null; weights: [P] float32
extern "C" __global__ void moe_down(scalar_t* __restrict__ out, const scalar_t* __restrict__ act,
                                    const scalar_t* __restrict__ down, const scalar_t* __restrict__ down_bias,
                                    const float* __restrict__ weights, const long long* __restrict__ sorted_pairs,
                                    const long long* __restrict__ tile_expert, int num_pairs, int num_experts,
                                    int hidden, int inner) {
  __shared__ long long pairs[BLOCK_M];
  __shared__ const scalar_t* rows[BLOCK_M];
  const long long expert =
      tile_rows(pairs, rows, sorted_pairs, tile_expert, num_pairs, num_experts, act, 1, inner);
  if (expert < 0) return;
  const int n0 = blockIdx.y * BLOCK_N;
  float acc[1][THREAD_M][THREAD_N];
  multiply<1>(acc, rows, down + (expert * hidden + n0) * inner, 0, min(BLOCK_N, hidden - n0), inner);
  each_output(pairs, n0, hidden, [&](int i, int j, long long pair, int column) {
    float y = acc[0][i][j];
    if (down_bias != nullptr) y += to_float(down_bias[expert * hidden + column]);
    out[pair * hidden + column] = from_float(rounded(y) * weights[pair]);  // F.linear's rounding, then weighed
  });
}
