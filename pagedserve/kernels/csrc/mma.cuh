// Tensor-core and asynchronous-copy primitives for 16-bit element types, as inline PTX (sm_80 and newer).
// csrc/emulate.h has the host's versions, with the same fragment layouts, for the emulator.
//
// Fragments of mma.m16n8k16 (row.col), for lane l, group = l / 4, pair = 2 * (l % 4):
//   A (16 x 16, 4 registers of two elements): a0 rows group, cols pair..pair+1; a1 rows group + 8;
//     a2 cols pair + 8; a3 rows group + 8, cols pair + 8.
//   B (16 x 8, 2 registers): b0 rows (k) pair..pair+1, col (n) group; b1 rows pair + 8.
//   C and D (16 x 8, 4 floats): c0, c1 row group, cols pair, pair + 1; c2, c3 row group + 8.
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit elements: lanes 8j..8j+7 give the addresses of matrix j's
// rows, and lane l receives in register j row l / 4, elements pair..pair+1 of matrix j (with .trans, the
// transposed matrix's).

#ifndef PAGEDSERVE_EMULATE

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  unsigned address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
}

// 16 bytes from global to shared memory, without registers; zero-filled when !valid.
__device__ __forceinline__ void cp_async_16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(shared)), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

#if defined(DTYPE_BF16)
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

// d += a b, in float.
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#else  // the emulator's: copies done at the wait, fragments exchanged among the warp's lanes

inline void cp_async_16(void* shared, const void* global, bool valid) {
  emu::require_aligned(shared, 16, "cp.async to shared memory");
  if (valid) emu::require_aligned(global, 16, "cp.async from global memory");
  emu::self().uncommitted.push_back({shared, global, valid});
#ifdef PAGEDSERVE_RACECHECK
  emu::race::access(shared, 16, true, /*copy_issued=*/true);  // written when waited for, not before
#endif
}
inline void cp_async_commit() {
  emu::Fiber& f = emu::self();
  f.in_flight.push_back(std::move(f.uncommitted));
  f.uncommitted.clear();
}
template <int N>
void cp_async_wait() {
  emu::Fiber& f = emu::self();
  while (f.in_flight.size() > N) {
    for (const emu::Copy& copy : f.in_flight.front()) {
      if (copy.valid) std::memcpy(copy.shared, copy.global, 16);
      else std::memset(copy.shared, 0, 16);
#ifdef PAGEDSERVE_RACECHECK
      emu::race::access(copy.shared, 16, true);  // the copy lands: this thread's write, in this interval
#endif
    }
    f.in_flight.erase(f.in_flight.begin());
  }
}

inline unsigned short element_bits(const void* row, int column) {
  unsigned short bits;
  std::memcpy(&bits, static_cast<const char*>(row) + 2 * column, 2);
  return bits;
}

template <bool Transposed>
void ldmatrix(unsigned (&r)[4], const void* row) {
  emu::require_aligned(row, 16, "an ldmatrix row");
  uint64_t rows[emu::kWarpSize];
  emu::gather(reinterpret_cast<uint64_t>(row), rows);
  const int lane = emu::lane(), group = lane / 4, pair = 2 * (lane % 4);
  for (int j = 0; j < 4; ++j) {
    const void* const* matrix = reinterpret_cast<const void* const*>(rows + 8 * j);
    const unsigned low = Transposed ? element_bits(matrix[pair], group) : element_bits(matrix[group], pair);
    const unsigned high = Transposed ? element_bits(matrix[pair + 1], group) : element_bits(matrix[group], pair + 1);
    r[j] = low | (high << 16);
  }
}
inline void ldmatrix_x4(unsigned (&r)[4], const void* row) { ldmatrix<false>(r, row); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { ldmatrix<true>(r, row); }

inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  uint64_t a01[emu::kWarpSize], a23[emu::kWarpSize], b[emu::kWarpSize];
  emu::gather(a[0] | (uint64_t)a[1] << 32, a01);
  emu::gather(a[2] | (uint64_t)a[3] << 32, a23);
  emu::gather(b0 | (uint64_t)b1 << 32, b);
  // Register reg of a lane: registers 0 and 1 of A travel in a01, 2 and 3 in a23; element half of it.
  const auto element = [](const uint64_t* lanes, int lane, int reg, int half) {
    return to_float((scalar_t)((lanes[lane] >> (32 * (reg % 2) + 16 * half)) & 0xffffu));
  };
  const auto a_at = [&](int row, int k) {
    const int reg = row / 8 + 2 * (k / 8);
    return element(reg < 2 ? a01 : a23, (row % 8) * 4 + (k % 8) / 2, reg, k % 2);
  };
  const auto b_at = [&](int k, int n) { return element(b, n * 4 + (k % 8) / 2, k / 8, k % 2); };
  const int lane = emu::lane(), group = lane / 4, pair = 2 * (lane % 4);
  for (int i = 0; i < 4; ++i) {
    const int row = group + 8 * (i / 2), col = pair + i % 2;
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
    d[i] += sum;
  }
}

#endif  // PAGEDSERVE_EMULATE

// Stores two elements (a packed register) at p, which must be 4-byte aligned.
__device__ __forceinline__ void store_pair(scalar_t* p, unsigned packed) {
#ifdef PAGEDSERVE_EMULATE
  emu::require_aligned(p, 4, "a 4-byte store");
#endif
  *reinterpret_cast<unsigned*>(p) = packed;
}

// Two floats as the element type, low half first, as an A or B fragment register holds them.
__device__ __forceinline__ unsigned pack_pair(float low, float high) {
  return (unsigned)from_float(low) | ((unsigned)from_float(high) << 16);
}

// One tile of the online softmax over a warp's 16 rows: s holds the tile's scores as C fragments, scaled to
// log2 units and masked to NEG_LARGE. Finds each row's new maximum (the 4 lanes of a row agree through two
// shuffles), turns s into exp2(s - max), adds it to this lane's part of each row's sum, and returns in
// rescale what the output so far must be multiplied by.
template <int N_TILES>
__device__ __forceinline__ void softmax_tile(float (&s)[N_TILES][4], float (&row_max)[2], float (&row_sum)[2],
                                             float (&rescale)[2]) {
  float tile_max[2] = {NEG_LARGE, NEG_LARGE};
#pragma unroll
  for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) tile_max[i / 2] = fmaxf(tile_max[i / 2], s[nt][i]);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
    tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
    const float new_max = fmaxf(row_max[half], tile_max[half]);
    rescale[half] = exp2f(row_max[half] - new_max);
    row_max[half] = new_max;
    row_sum[half] *= rescale[half];
  }
#pragma unroll
  for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[nt][i] = exp2f(s[nt][i] - row_max[i / 2]);
      row_sum[i / 2] += s[nt][i];
    }
  }
}
