// The storage types the CPU ops read and write, and their conversions to the float32 every op computes in.
//
// Activations and the KV pool are float32 or bfloat16 (a float32 model may keep a bfloat16 pool); a linear layer's weight may also be
// int8 or float8 (e4m3), with a float32 scale per output row. bfloat16 is the top half of a float32, so
// widening it is a shift; narrowing rounds to nearest even, as torch's .to(torch.bfloat16) does. Each
// conversion has a scalar form and a vector form of GCC's vector extensions, as wide as the build's CPU
// (-march): the compiler turns them into its widening moves, shifts and converts, with no intrinsics.

#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// What the kernels that multiply bfloat16 pairs with vdpbf16ps (paged_decode.cpp's scores, paged_prefill.cpp's
// products) are compiled for, whatever the build's x86-64 level: what cpu_features.py's avx512_bf16 probe ran
// before the Python side asks for them.
#define DOT_BF16_TARGET __attribute__((target("avx512f,avx512bf16")))

namespace pagedserve {

using bf16 = c10::BFloat16;
using fp8 = c10::Float8_e4m3fn;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t U32Vec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t I32Vec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint16_t U16Vec __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// Scalars ------------------------------------------------------------------------------------------------

inline float to_float(float v) { return v; }

inline float to_float(bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline float to_float(int8_t v) { return static_cast<float>(v); }

inline float to_float(fp8 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v);

template <>
inline float from_float<float>(float v) {
  return v;
}

template <>
inline bf16 from_float<bf16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return bf16(static_cast<uint16_t>(bits >> 16), bf16::from_bits());
}

// v as T holds it: what storing v in a T and reading it back gives (transformers rounds each op's result
// to the model's dtype; the ops round where it does).
template <typename T>
inline float round_to(float v) {
  return to_float(from_float<T>(v));
}

// silu(gate) * up as transformers computes it in T: the activation rounded to T, then the product (gate and
// up already T's values). The gate stops at -88, where exp(-gate) is just below float32's overflow:
// -ffast-math's division by infinity gave NaN for a gate below -88.7, and stopping exp's argument alone
// left gate / e^88, which is far from silu's -0 for a gate like -1e30. Below -88, silu is under 2e-36
// either way (0 where the vectorized exp rounds e^88 up to infinity).
template <typename T>
inline T silu_mul(float gate, float up) {
  const float g = std::max(gate, -88.0f);
  return from_float<T>(round_to<T>(g / (1.0f + std::exp(-g))) * up);
}

// Vectors: kLanes consecutive elements, read unaligned ----------------------------------------------------

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The widening loads take x86's widening moves where the build has them: GCC turns a convertvector of eight
// bytes into one element at a time.
inline Vec load(const bf16* p) {
#if defined(__AVX512F__)
  return (Vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (Vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  U16Vec half;
  std::memcpy(&half, p, sizeof half);
  return reinterpret_cast<Vec>(__builtin_convertvector(half, U32Vec) << 16);
#endif
}

// kLanes bytes widened to 32 bits, sign- or zero-extended.
template <bool kSigned>
inline I32Vec widen_bytes(const void* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return (I32Vec)(kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return (I32Vec)(kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  I32Vec wide;
  for (int lane = 0; lane < kLanes; ++lane) {
    const uint8_t byte = static_cast<const uint8_t*>(p)[lane];
    wide[lane] = kSigned ? static_cast<int8_t>(byte) : byte;
  }
  return wide;
#endif
}

inline Vec load(const int8_t* p) { return __builtin_convertvector(widen_bytes<true>(p), Vec); }

// e4m3 (bias 7, no infinities) widened exactly: its exponent and mantissa bits moved to float32's places
// read as a float32 with bias 127, so 2^120 rescales it; float32's own denormals carry e4m3's.
inline Vec load(const fp8* p) {
  const U32Vec wide = reinterpret_cast<U32Vec>(widen_bytes<false>(p));
  const U32Vec bits = ((wide & 0x7Fu) << 20) | ((wide & 0x80u) << 24);
  return reinterpret_cast<Vec>(bits) * 0x1p120f;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline void store(bf16* p, Vec v) {
  U32Vec bits = reinterpret_cast<U32Vec>(v);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  const U16Vec half = __builtin_convertvector(bits >> 16, U16Vec);
  std::memcpy(p, &half, sizeof half);
}

inline float sum_lanes(Vec v) {
  float sum = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) sum += v[lane];
  return sum;
}

// Dispatch ---------------------------------------------------------------------------------------------

// Calls body(T{}) with T the C++ type of t's dtype, float32 or bfloat16; a ValueError names t otherwise.
template <typename Body>
void with_float_type(const at::Tensor& t, const char* name, Body&& body) {
  switch (t.scalar_type()) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(bf16{}); break;
    default:
      TORCH_CHECK_VALUE(false, name, " must be float32 or bfloat16, not ", c10::getDtypeNames(t.scalar_type()).first);
  }
}

}  // namespace pagedserve
