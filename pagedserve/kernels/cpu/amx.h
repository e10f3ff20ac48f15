// AMX's tiles for the ops that multiply with them (paged_prefill.cpp's attention, packed_linear.cpp's int8
// GEMM) and for features.cpp's probe. Linux hands a process the tiles' state only when it asks (5.16+), and
// each thread loads its own tile configuration; every tile here is 16 rows of 64 bytes: 16 x 32 bfloat16,
// 16 x 64 bytes or 16 x 16 float32 or int32. A thread releases its tiles when done, so that oneDNN, which
// configures its own, and the kernel's context switches find them free.
//
// The kernels that use them are compiled for AMX and AVX-512 (AMX_TARGET), so that a build for any x86-64
// level has them; the Python side calls them only where cpu_features.py saw AMX run. An op asked to use the
// tiles where the kernel refuses them raises: it is asked only where the probe ran them.

#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")))

namespace pagedserve::amx {

constexpr int kRows = 16, kRowBytes = 64;

// Whether the kernel grants this process the tiles' state: asked once (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), and remembered.
inline bool request_tiles() {
  constexpr int kArchRequestPermission = 0x1023, kTileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchRequestPermission, kTileData) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 .. count - 1 configured for this thread while it lives, each kRows x kRowBytes. Compiled for
// amx-tile alone, so that features.cpp's probes, which must not run AVX-512 on a CPU without it, can use it.
class Tiles {
 public:
  __attribute__((target("amx-tile"))) explicit Tiles(int count) {
    TileConfig config;
    for (int tile = 0; tile < count; ++tile) {
      config.rows[tile] = kRows;
      config.bytes_per_row[tile] = kRowBytes;
    }
    // Not _tile_loadconfig: GCC's declares that it reads 8 bytes of the config, and drops the stores past them.
    __asm__ volatile("ldtilecfg %0" : : "m"(config));
  }
  __attribute__((target("amx-tile"))) ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

}  // namespace pagedserve::amx
#endif
