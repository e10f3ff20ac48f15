// Shared by every kernel: the element type and its conversions, and warp reductions.
//
// NVRTC compiles these sources with no CUDA headers, so 16-bit types travel as raw bits (CuPy has no
// bfloat16) and convert through float with PTX: cvt.rn rounds to nearest even, as torch does.
// Each source is compiled once per element type, chosen with -DDTYPE_F32, -DDTYPE_F16 or -DDTYPE_BF16.

#ifndef PAGEDSERVE_EMULATE  // pagedserve/kernels/csrc/emulate.h has the host's versions
__device__ __forceinline__ float half_bits_to_float(unsigned short x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
  unsigned short x;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
  return x;
}
__device__ __forceinline__ unsigned short float_to_bfloat16_bits(float f) {
  unsigned short x;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x) : "f"(f));
  return x;
}
#endif

#if defined(DTYPE_F32)
typedef float scalar_t;
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float from_float(float x) { return x; }
#elif defined(DTYPE_F16)
typedef unsigned short scalar_t;
__device__ __forceinline__ float to_float(unsigned short x) { return half_bits_to_float(x); }
__device__ __forceinline__ unsigned short from_float(float f) { return float_to_half_bits(f); }
#elif defined(DTYPE_BF16)
typedef unsigned short scalar_t;
__device__ __forceinline__ float to_float(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ unsigned short from_float(float f) { return float_to_bfloat16_bits(f); }
#else
#error "define DTYPE_F32, DTYPE_F16 or DTYPE_BF16"
#endif

// A thread's VEC consecutive elements, loaded or stored as one access: VEC is 16 bytes' worth (8 of a 16-bit
// type, 4 floats) where the wrapper found every row it passes 16-byte aligned, and 1 where it did not.
#ifndef VEC
#define VEC 1
#endif
struct alignas(sizeof(scalar_t) * VEC) Pack {
  scalar_t v[VEC];
};
__device__ __forceinline__ Pack load_pack(const scalar_t* p) {
#ifdef PAGEDSERVE_EMULATE
  emu::require_aligned(p, sizeof(Pack), "a vector load");
#endif
  return *reinterpret_cast<const Pack*>(p);
}
__device__ __forceinline__ void store_pack(scalar_t* p, const Pack& x) {
#ifdef PAGEDSERVE_EMULATE
  emu::require_aligned(p, sizeof(Pack), "a vector store");
#endif
  *reinterpret_cast<Pack*>(p) = x;
}

// The block's dynamic shared memory (the launch's shared_mem bytes), as `char* name`, 16-byte aligned.
#ifdef PAGEDSERVE_EMULATE
#define DYNAMIC_SHARED(name) char* name = emu::dynamic_shared
#else
struct alignas(16) SharedBytes {
  char bytes[16];
};
#define DYNAMIC_SHARED(name)                 \
  extern __shared__ SharedBytes name##_[]; \
  char* name = reinterpret_cast<char*>(name##_)
#endif

#define WARP_SIZE 32
#define NEG_LARGE (-1e30f)  // a running max that exp() turns into 0 without inf - inf = NaN

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The sum over a block of up to 1024 threads; every thread gets it. scratch holds blockDim.x / 32 floats.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  const int warps = (blockDim.x + WARP_SIZE - 1) / WARP_SIZE;
  x = lane < warps ? scratch[lane] : 0.f;
  x = warp_sum(x);
  __syncthreads();  // scratch may be reused right after
  return x;
}
