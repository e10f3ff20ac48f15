// Runs one instruction of a CPU feature on known inputs and says whether it gave the known answer:
// pagedserve/kernels/cpu_features.py calls this in a child process, where an instruction the CPU or the kernel refuses
// (SIGILL) ends the child, not the worker. Each probe is compiled for its feature alone (a target
// attribute), so that a build for any x86-64 level has them all.

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>

#include "amx.h"

namespace {

constexpr uint16_t kOne = 0x3F80, kTwo = 0x4000;  // 1.0 and 2.0 as bfloat16

// vdpbf16ps: each float32 lane adds the products of its two bf16 pairs: 0.5 + 1 * 2 + 1 * 2.
__attribute__((target("avx512f,avx512bf16"))) bool avx512_bf16() {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(static_cast<int16_t>(kOne));
  const __m512bh twos = (__m512bh)_mm512_set1_epi16(static_cast<int16_t>(kTwo));
  float out[16];
  _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_set1_ps(0.5f), ones, twos));
  for (const float v : out) {
    if (v != 4.5f) return false;
  }
  return true;
}

// vpdpbusd: each int32 lane adds the products of its four unsigned and signed byte pairs: 5 + 4 * 200 * -3.
__attribute__((target("avx512f,avx512vnni"))) bool avx512_vnni() {
  int32_t out[16];
  _mm512_storeu_si512(out, _mm512_dpbusd_epi32(_mm512_set1_epi32(5), _mm512_set1_epi8(static_cast<char>(200)),
                                               _mm512_set1_epi8(-3)));
  for (const int32_t v : out) {
    if (v != 5 - 2400) return false;
  }
  return true;
}

// AMX: the kernel must grant this process the tiles' state, then one tile product of bf16 pairs:
// C[16 x 16] = A[16 x 32] B[16 pairs x 16 x 2], each sum 32 * 1 * 2.
__attribute__((target("amx-tile,amx-bf16"))) bool amx_bf16() {
  TORCH_CHECK(pagedserve::amx::request_tiles(), "the kernel does not grant this process AMX's tile state");
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  std::fill_n(a, 16 * 32, kOne);
  std::fill_n(b, 16 * 32, kTwo);
  {
    pagedserve::amx::Tiles tiles(3);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
  }
  for (const float v : c) {
    if (v != 64.0f) return false;
  }
  return true;
}

// AMX-INT8: one tile product of unsigned by signed bytes, C[16 x 16] = A[16 x 64] B[16 fours x 16 x 4], each
// sum 64 * 200 * -3.
__attribute__((target("amx-tile,amx-int8"))) bool amx_int8() {
  TORCH_CHECK(pagedserve::amx::request_tiles(), "the kernel does not grant this process AMX's tile state");
  alignas(64) uint8_t a[16 * 64];
  alignas(64) int8_t b[16 * 64];
  alignas(64) int32_t c[16 * 16];
  std::fill_n(a, 16 * 64, uint8_t{200});
  std::fill_n(b, 16 * 64, int8_t{-3});
  {
    pagedserve::amx::Tiles tiles(3);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbusd(0, 1, 2);
    _tile_stored(0, c, 64);
  }
  for (const int32_t v : c) {
    if (v != 64 * 200 * -3) return false;
  }
  return true;
}

}  // namespace
#endif

// Whether feature (avx512_bf16, avx512_vnni, amx_bf16 or amx_int8) ran and gave the right answer; an unknown name is a ValueError.
bool probe_feature(const std::string& feature) {
#if defined(__x86_64__)
  if (feature == "avx512_bf16") return avx512_bf16();
  if (feature == "avx512_vnni") return avx512_vnni();
  if (feature == "amx_bf16") return amx_bf16();
  if (feature == "amx_int8") return amx_int8();
#endif
  TORCH_CHECK_VALUE(feature == "avx512_bf16" || feature == "avx512_vnni" || feature == "amx_bf16" ||
                        feature == "amx_int8",
                    "no probe for ", feature);
  return false;  // not an x86-64 CPU
}
