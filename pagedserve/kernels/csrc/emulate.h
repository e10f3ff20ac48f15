// The CUDA kernels of csrc/, compiled by the host's C++ compiler and run on the CPU (pagedserve/kernels/emulator.py).
//
// Each CUDA thread of a block is a fiber on one OS thread: a fiber runs until it reaches a barrier
// (__syncthreads, a warp shuffle, __syncwarp), then the next one runs. A block's threads run round-robin
// until all are done, then the next block starts, so `__shared__` arrays can be one static array per
// kernel. Warp shuffles exchange through a slot per lane, behind a warp barrier: every lane of the warp must
// reach the same shuffle, as on a GPU with a full mask. This is for checking results against the torch
// reference; it says nothing about speed.
//
// Round-robin fibers hide races: a thread that reads shared memory another wrote without a barrier between
// them sees the write if the writer happened to run first. With PAGEDSERVE_RACECHECK (the emulator's
// PAGEDSERVE_EMULATE_RACECHECK=1), every load and store is instrumented (GCC's -fsanitize=thread, whose
// __tsan_* hooks are defined here, not ThreadSanitizer's runtime), and each byte of shared memory records
// which thread last wrote it and last read it, and how many __syncthreads and __syncwarp that thread had
// passed then. A read of another thread's write, or a write over another thread's read or write, that no
// barrier both threads passed since orders (a __syncthreads, or a __syncwarp of their warp; a shuffle does
// not order memory) fails the launch, as compute-sanitizer's racecheck does on a GPU; so does a read of a
// byte no thread of the block wrote (shared memory starts each block filled with 0xff, as garbage), and a
// read of a cp.async target before its copy was waited for (synccheck's cp.async rule).
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#define PAGEDSERVE_EMULATE 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#ifdef PAGEDSERVE_RACECHECK
// Static shared arrays in a section of their own, so that the checker knows their bytes.
#define __shared__ static __attribute__((section("emu_shared")))
#else
#define __shared__ static  // one block at a time (see above)
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace emu {

constexpr int kWarpSize = 32;
constexpr std::size_t kStackBytes = 256 * 1024;

struct Barrier {
  int size = 0, arrived = 0;
  unsigned long long generation = 0;
};

// A cp.async copy, done when the thread waits for its group (csrc/mma.cuh): a kernel that reads shared memory
// before waiting, or before the barrier after the wait, reads what was there before.
struct Copy {
  void* shared;
  const void* global;
  bool valid;
};

struct Fiber {
  dim3 thread_idx;
  int flat = 0;  // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
  unsigned block_syncs = 0, warp_syncs = 0;  // the __syncthreads, and the __syncwarp or __syncthreads, passed
  bool started = false, done = false;
  std::vector<Copy> uncommitted;
  std::vector<std::vector<Copy>> in_flight;  // committed groups, oldest first
  ucontext_t start;
  jmp_buf resume;
  std::vector<char> stack;
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Barrier> warps;
  Barrier all;
  std::vector<uint64_t> slots[2];  // a shuffle's values, double-buffered by the warp's generation
  Fiber* current = nullptr;
  jmp_buf scheduler;
  std::string fault;  // the first thing a thread did that a GPU would refuse (see fault())
  void (*body)() = nullptr;
};

inline Block* block = nullptr;
inline dim3 block_idx, block_dim, grid_dim;
inline char* dynamic_shared = nullptr;  // the launch's shared_mem bytes, then kGuardBytes of a known pattern
constexpr std::size_t kGuardBytes = 4096;
constexpr char kGuard = 0x5a;

inline void yield() {
  if (_setjmp(block->current->resume) == 0) _longjmp(block->scheduler, 1);
}

inline void arrive(Barrier& barrier) {
  if (++barrier.arrived == barrier.size) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  const unsigned long long generation = barrier.generation;
  while (barrier.generation == generation) yield();
}

inline void fiber_main() {
  block->body();
  block->current->done = true;
  _longjmp(block->scheduler, 1);
}

// Runs body() once per thread of the current block, until every thread has returned.
inline void run_block() {
  Block& b = *block;
  for (Fiber& f : b.fibers) {
    f.started = f.done = false;
    f.block_syncs = f.warp_syncs = 0;
    f.uncommitted.clear();
    f.in_flight.clear();
  }
  for (bool pending = true; pending;) {
    pending = false;
    for (Fiber& f : b.fibers) {
      if (f.done) continue;
      b.current = &f;
      if (_setjmp(b.scheduler) == 0) {
        if (!f.started) {
          f.started = true;
          getcontext(&f.start);
          f.start.uc_stack.ss_sp = f.stack.data();
          f.start.uc_stack.ss_size = f.stack.size();
          f.start.uc_link = nullptr;
          makecontext(&f.start, fiber_main, 0);
          setcontext(&f.start);
        }
        _longjmp(f.resume, 1);
      }
      pending |= !f.done;
    }
  }
  for (const Barrier& w : b.warps)
    if (w.arrived) throw std::runtime_error("a warp's threads left the kernel with some waiting at a shuffle");
  if (b.all.arrived) throw std::runtime_error("threads left the kernel with some waiting at __syncthreads");
  if (!b.fault.empty()) throw std::runtime_error(b.fault);
}

inline Fiber& self() { return *block->current; }

// Records what a GPU would fault on (a misaligned access, say); the launch fails with it once the block ends.
inline void fault(const std::string& what) {
  if (block->fault.empty()) block->fault = what;
}

inline void require_aligned(const void* address, std::size_t alignment, const char* what) {
  if (reinterpret_cast<uintptr_t>(address) % alignment != 0)
    fault(std::string(what) + " at an address not aligned to " + std::to_string(alignment) + " bytes");
}

inline int lane() { return self().flat % kWarpSize; }

inline Barrier& my_warp() { return block->warps[self().flat / kWarpSize]; }

// Puts this lane's value in its slot and waits until every lane of the warp has put its own: the warp's
// slots, lane 0's first, which hold until the warp's meeting after next (they are double-buffered).
inline const uint64_t* meet(uint64_t value) {
  Barrier& warp = my_warp();
  std::vector<uint64_t>& slots = block->slots[warp.generation & 1];
  slots[self().flat] = value;
  arrive(warp);
  return slots.data() + self().flat - lane();
}

// Every lane's value, in lane order.
inline void gather(uint64_t value, uint64_t (&all)[kWarpSize]) {
  const uint64_t* lanes = meet(value);
  std::copy(lanes, lanes + my_warp().size, all);
}

// Every lane puts its value, then reads the value of lane `source(lane)`: that one alone, as a shuffle is
// the emulator's most frequent meeting.
template <class T, class Source>
T exchange(T value, Source source) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  const uint64_t* lanes = meet(bits);
  const int from = source(lane());
  if (from < 0 || from >= my_warp().size) return value;  // out of the warp: a GPU returns the lane's own value
  T out;
  std::memcpy(&out, &lanes[from], sizeof(T));
  return out;
}

}  // namespace emu

#define threadIdx (emu::self().thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() {
  emu::arrive(emu::block->all);
  ++emu::self().block_syncs;
  ++emu::self().warp_syncs;
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  emu::arrive(emu::my_warp());
  ++emu::self().warp_syncs;
}

#ifdef PAGEDSERVE_RACECHECK
namespace emu::race {

// One thread's access to a byte: who, and in which barrier interval. thread < 0: none.
struct Access {
  int thread = -1;
  unsigned block_syncs = 0, warp_syncs = 0;
};
struct Shadow {
  Access write, read;
  bool copying = false;  // a cp.async target whose copy is not waited for yet
};

struct Region {
  char* begin = nullptr;
  std::size_t size = 0;
  const char* name = "";
  std::vector<Shadow> shadow;
};
inline Region regions[2];  // the launch's dynamic shared memory, and the kernel's static __shared__ arrays

extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

// A block starts with garbage in every byte of shared memory, and nothing written.
__attribute__((no_sanitize("thread"))) inline void start_block(char* dynamic, std::size_t dynamic_bytes) {
  regions[0].begin = dynamic, regions[0].size = dynamic_bytes, regions[0].name = "dynamic shared memory";
  regions[1].begin = __start_emu_shared, regions[1].name = "a __shared__ array";
  regions[1].size = __start_emu_shared ? static_cast<std::size_t>(__stop_emu_shared - __start_emu_shared) : 0;
  for (Region& r : regions) {
    if (r.size) std::memset(r.begin, 0xff, r.size);
    r.shadow.assign(r.size, Shadow{});
  }
}

__attribute__((no_sanitize("thread"))) inline bool ordered(const Access& before, const Fiber& now) {
  return before.thread == now.flat || now.block_syncs > before.block_syncs ||
         (before.thread / kWarpSize == now.flat / kWarpSize && now.warp_syncs > before.warp_syncs);
}

__attribute__((no_sanitize("thread"))) inline void report(const char* what, const Region& r, std::size_t at,
                                                           const Fiber& now, const Access& other) {
  fault("race in " + std::string(r.name) + " at byte " + std::to_string(at) + ": thread " +
        std::to_string(now.flat) + " " + what + " thread " + std::to_string(other.thread) +
        " with no __syncthreads, or __syncwarp of their warp, that both passed in between");
}

__attribute__((no_sanitize("thread"))) inline void access(const void* address, std::size_t n, bool write,
                                                           bool copy_issued = false) {
  if (block == nullptr || block->current == nullptr) return;
  const char* p = static_cast<const char*>(address);
  for (Region& r : regions) {
    if (r.size == 0 || p < r.begin || p + n > r.begin + r.size) continue;
    const Fiber& me = *block->current;
    const Access mine{me.flat, me.block_syncs, me.warp_syncs};
    for (std::size_t at = p - r.begin, end = at + n; at < end; ++at) {
      Shadow& s = r.shadow[at];
      if (!block->fault.empty()) return;  // one report a launch
      if (write) {
        if (s.write.thread >= 0 && !ordered(s.write, me)) report("writes what was written by", r, at, me, s.write);
        else if (s.read.thread >= 0 && !ordered(s.read, me)) report("writes what was read by", r, at, me, s.read);
        s.write = mine, s.read = Access{}, s.copying = copy_issued;
      } else {
        if (s.write.thread < 0) {
          fault("thread " + std::to_string(me.flat) + " reads byte " + std::to_string(at) + " of " + r.name +
                " that no thread of its block wrote");
        } else if (s.copying) {
          report("reads a cp.async target before its copy was waited for, issued by", r, at, me, s.write);
        } else if (!ordered(s.write, me)) {
          report("reads what was written by", r, at, me, s.write);
        }
        s.read = mine;
      }
    }
    return;
  }
}

// Whether p is in shared memory: most of the loads and stores the hooks see are not, and this is all they
// cost then.
__attribute__((no_sanitize("thread"))) inline bool in_shared(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  for (const Region& r : regions)
    if (address - reinterpret_cast<uintptr_t>(r.begin) < r.size) return true;
  return false;
}

}  // namespace emu::race

// The hooks GCC's -fsanitize=thread calls around each memory access (and at load); only shared memory counts.
#define EMU_RACE_HOOK(name, n, write)                                    \
  extern "C" __attribute__((no_sanitize("thread"))) void name(void* p) { \
    if (emu::race::in_shared(p)) emu::race::access(p, n, write);        \
  }
#define EMU_RACE_HOOKS(n)                           \
  EMU_RACE_HOOK(__tsan_read##n, n, false)           \
  EMU_RACE_HOOK(__tsan_write##n, n, true)           \
  EMU_RACE_HOOK(__tsan_unaligned_read##n, n, false) \
  EMU_RACE_HOOK(__tsan_unaligned_write##n, n, true)
EMU_RACE_HOOKS(1)
EMU_RACE_HOOKS(2)
EMU_RACE_HOOKS(4)
EMU_RACE_HOOKS(8)
EMU_RACE_HOOKS(16)
#undef EMU_RACE_HOOKS
#undef EMU_RACE_HOOK
extern "C" __attribute__((no_sanitize("thread"))) void __tsan_read_range(void* p, unsigned long n) {
  emu::race::access(p, n, false);
}
extern "C" __attribute__((no_sanitize("thread"))) void __tsan_write_range(void* p, unsigned long n) {
  emu::race::access(p, n, true);
}
extern "C" __attribute__((no_sanitize("thread"))) void __tsan_init() {}
extern "C" __attribute__((no_sanitize("thread"))) void __tsan_func_entry(void*) {}
extern "C" __attribute__((no_sanitize("thread"))) void __tsan_func_exit() {}
#endif  // PAGEDSERVE_RACECHECK

template <class T>
T __shfl_xor_sync(unsigned, T value, int mask) {
  return emu::exchange(value, [mask](int lane) { return lane ^ mask; });
}

// CUDA's math and bit intrinsics, as the host computes them.
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// The 16-bit conversions common.cuh does with PTX's cvt: round to nearest even, as torch does.
inline float half_bits_to_float(unsigned short x) {
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return static_cast<float>(h);
}
inline unsigned short float_to_half_bits(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  unsigned short x;
  std::memcpy(&x, &h, 2);
  return x;
}
inline unsigned short float_to_bfloat16_bits(float f) {
  const unsigned bits = __float_as_uint(f);
  if (std::isnan(f)) return 0x7fff;  // PTX's canonical NaN
  return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

namespace emu {

// Calls a kernel with arguments from an array of pointers to their values, as cuLaunchKernel takes them;
// sizes[i] is the byte size the caller packed for argument i, checked against the kernel's parameter.
template <class... Params, std::size_t... I>
void call(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<Params*>(args[I])...);
}

template <class... Params>
std::string launch(void (*kernel)(Params...), dim3 grid, dim3 threads, std::size_t shared_bytes, void** args,
                   const int64_t* sizes, int count) {
  constexpr int expected = sizeof...(Params);
  if (count != expected)
    return "the kernel takes " + std::to_string(expected) + " arguments, got " + std::to_string(count);
  const std::size_t param_sizes[] = {sizeof(Params)..., 0};
  for (int i = 0; i < count; ++i)
    if (static_cast<std::size_t>(sizes[i]) != param_sizes[i])
      return "argument " + std::to_string(i) + " is " + std::to_string(sizes[i]) + " bytes, the kernel's " +
             std::to_string(param_sizes[i]);
  const unsigned threads_per_block = threads.x * threads.y * threads.z;
  if (threads_per_block == 0 || threads_per_block > 1024) return "a block of 1 to 1024 threads";

  Block b;
  b.fibers.resize(threads_per_block);
  for (unsigned t = 0; t < threads_per_block; ++t) {
    Fiber& f = b.fibers[t];
    f.flat = static_cast<int>(t);
    f.thread_idx = {t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y)};
    f.stack.resize(kStackBytes);
  }
  for (unsigned first = 0; first < threads_per_block; first += kWarpSize) {
    Barrier warp;
    warp.size = static_cast<int>(std::min<unsigned>(kWarpSize, threads_per_block - first));
    b.warps.push_back(warp);
  }
  b.all.size = static_cast<int>(threads_per_block);
  b.slots[0].assign(threads_per_block, 0);
  b.slots[1].assign(threads_per_block, 0);
  static void** pending_args;
  static void (*pending_kernel)(Params...);
  pending_args = args;
  pending_kernel = kernel;
  b.body = [] { call(pending_kernel, pending_args, std::index_sequence_for<Params...>{}); };
  std::vector<char> shared(shared_bytes + kGuardBytes + 128, kGuard);
  dynamic_shared = shared.data() + (128 - reinterpret_cast<uintptr_t>(shared.data()) % 128);
  block = &b;
  block_dim = threads;
  grid_dim = grid;
  try {
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          block_idx = {x, y, z};
#ifdef PAGEDSERVE_RACECHECK
          race::start_block(dynamic_shared, shared_bytes);
#endif
          run_block();
          for (std::size_t i = 0; i < kGuardBytes; ++i)
            if (dynamic_shared[shared_bytes + i] != kGuard)
              throw std::runtime_error("a block wrote past its " + std::to_string(shared_bytes) +
                                       " bytes of dynamic shared memory");
        }
  } catch (const std::exception& error) {
    block = nullptr;
    return error.what();
  }
  block = nullptr;
  return "";
}

}  // namespace emu

// One C entry point per kernel, for ctypes: returns 0, or 1 with the reason in `error` (a buffer of 512).
// The only symbols the library exports (it is built with -fvisibility=hidden, so that its own calls and
// variables need no lookup through the GOT: the race checker's hooks run at every load and store).
#define EMULATE_ENTRY(function)                                                                          \
  extern "C" __attribute__((visibility("default"))) int emulate_##function(                             \
      unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, int64_t shared_bytes, \
      void** args, const int64_t* sizes, int count, char* error) {                                       \
    const std::string message =                                                                          \
        emu::launch(function, {gx, gy, gz}, {bx, by, bz}, shared_bytes, args, sizes, count);            \
    std::snprintf(error, 512, "%s", message.c_str());                                                   \
    return message.empty() ? 0 : 1;                                                                      \
  }
