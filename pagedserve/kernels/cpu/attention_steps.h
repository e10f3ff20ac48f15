// What paged_prefill.cpp and paged_decode.cpp share so that a query's row comes out the same, bit for bit,
// from either: the steps of keys its softmax runs over, and, for the bfloat16 products (vdpbf16ps), one
// step's softmax. A decode then computes what a prefill computes for the same token, so a sequence's output
// does not depend on how its tokens were batched or chunked, or on a failover that recomputes some of them.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "floats.h"

namespace pagedserve::attention {

constexpr int64_t kStepKeys = 128;  // keys a step of the softmax

// The keys a query at position p sees: [lo, p].
inline int64_t first_key(int64_t p, int64_t window) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// The first key of the step of kStepKeys keys that holds key j.
inline int64_t step_of(int64_t j) { return j / kStepKeys * kStepKeys; }

// The keys [lo, hi) among a step's `keys` from k0 that a query at position p sees (none where lo >= hi).
inline std::pair<int64_t, int64_t> seen_in_step(int64_t p, int64_t k0, int64_t keys, int64_t window) {
  return {std::max<int64_t>(first_key(p, window) - k0, 0), std::min(p + 1 - k0, keys)};
}

// One query row's step of the float32 attention: its running max (top) and sum after its scaled scores
// against the step's keys [lo, hi) (row: the step's `keys` of them), which become its weights (zero elsewhere
// among the `keys`), and the factor its output so far takes (rescale). Compiled once (noinline), so that the
// prefill's rows and the decode's take the very same instructions (the vectorized exp and sum).
__attribute__((noinline)) inline void float_softmax_step(float* row, int64_t lo, int64_t hi, int64_t keys,
                                                          float softcap, float& top_of, float& sum_of,
                                                          float& rescale) {
  if (lo >= hi) {  // this token sees none of the step's keys
    std::fill_n(row, keys, 0.0f);
    rescale = 1.0f;
    return;
  }
  std::fill(row, row + lo, 0.0f);
  std::fill(row + hi, row + keys, 0.0f);
  if (softcap > 0.0f) {
    for (int64_t j = lo; j < hi; ++j) row[j] = softcap * std::tanh(row[j] / softcap);
  }
  float top = top_of;
  Vec tops = top - Vec{};  // GCC leaves a max reduction of floats scalar, even under omp simd
  int64_t j = lo;
  for (; j + kLanes <= hi; j += kLanes) {
    const Vec scores = load(row + j);
    tops = scores > tops ? scores : tops;
  }
  for (; j < hi; ++j) top = std::max(top, row[j]);
  for (int lane = 0; lane < kLanes; ++lane) top = std::max(top, tops[lane]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = lo; j < hi; ++j) {
    row[j] = std::exp(row[j] - top);
    sum += row[j];
  }
  rescale = std::exp(top_of - top);
  sum_of = sum_of * rescale + sum;
  top_of = top;
}

#if defined(__x86_64__)
constexpr float kLog2e = 1.44269504f;

// 2^t for t <= 0 in the lanes of `seen`, zero in the others: t = n + f, |f| <= 1/2, 2^f by a polynomial of
// degree 5 fitted to it there (relative error below 2.2e-7 in float32), times 2^n. t below -126 gives 2^-126.
DOT_BF16_TARGET inline __m512 exp2_nonpositive(__mmask16 seen, __m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.32669706e-3f);
  for (const float c : {9.67545994e-3f, 5.55074252e-2f, 2.40221217e-1f, 6.93146944e-1f, 1.00000012f}) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  }
  return _mm512_maskz_scalef_ps(seen, p, n);
}

// The bfloat16 pair at p (two consecutive values) in every 32-bit lane: a row's operand for vdpbf16ps.
DOT_BF16_TARGET inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// One query row's step of the bfloat16 attention: its running max (top), sum and output (acc, dim floats)
// rescaled after its unscaled scores against the step's keys [lo, hi) (row: kStepKeys of them), and its
// weights as their two bfloat16 halves (high, low: kStepKeys each; zero outside [lo, hi)), 32 keys at a time:
// the keys past hi up to a multiple of 32 are read, and masked off. Compiled once (noinline), so that the
// prefill's rows and the decode's take the very same instructions: -ffast-math may otherwise reassociate
// the sums differently where each is inlined.
DOT_BF16_TARGET __attribute__((noinline)) inline void softmax_step(float* row, uint16_t* high, uint16_t* low,
                                                                    int64_t lo, int64_t hi, float scale_of,
                                                                    float softcap, float& top_of, float& sum_of,
                                                                    float* acc, int64_t dim) {
  if (lo >= hi) {  // this token sees none of the step's keys
    std::fill_n(high, kStepKeys, 0);
    std::fill_n(low, kStepKeys, 0);
    return;
  }
  const int64_t first = lo / 32 * 32, end = round_up(hi, 32);  // the weights written below
  for (int64_t j = 0; j < kStepKeys; j += 32) {
    if (j < first || j >= end) {
      _mm512_storeu_si512(high + j, _mm512_setzero_si512());
      _mm512_storeu_si512(low + j, _mm512_setzero_si512());
    }
  }
  if (softcap > 0.0f) {
    for (int64_t j = lo; j < hi; ++j) row[j] = softcap * std::tanh(row[j] * scale_of / softcap) / scale_of;
  }
  // The lanes of keys [j, j + 16) in [lo, hi), as two comparisons of their indices. (GCC does not pass a
  // function's target to the lambdas inside it.)
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i from = _mm512_set1_epi32(static_cast<int32_t>(lo)), to = _mm512_set1_epi32(static_cast<int32_t>(hi));
  const auto seen = [&](int64_t j) DOT_BF16_TARGET {
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(j)));
    return _mm512_mask_cmplt_epi32_mask(_mm512_cmpge_epi32_mask(key, from), key, to);
  };
  __m512 top[2] = {_mm512_set1_ps(-1e30f), _mm512_set1_ps(-1e30f)};  // two chains of maxes, not one
  for (int64_t j = first; j < end; j += 32) {
    for (int v = 0; v < 2; ++v) {
      top[v] = _mm512_mask_max_ps(top[v], seen(j + 16 * v), top[v], _mm512_loadu_ps(row + j + 16 * v));
    }
  }
  const float was = top_of, now = std::max(was, _mm512_reduce_max_ps(_mm512_max_ps(top[0], top[1])) * scale_of);
  // A weight is e^x = 2^(x log2(e)), x = score * scale - now, which the FMA rounds once.
  const __m512 scale = _mm512_set1_ps(scale_of), shift = _mm512_set1_ps(now), log2e = _mm512_set1_ps(kLog2e);
  // A weight's high half is its first 8 significant bits (the bfloat16 it truncates to), and its low half
  // the bfloat16 of the rest, exact in float32: hi + lo is the weight to 2^-16 of it.
  const __m512i truncate = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = first; j < end; j += 32) {
    __m512 e[2], e_high[2];
    for (int v = 0; v < 2; ++v) {
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(row + j + 16 * v), scale, shift);
      e[v] = exp2_nonpositive(seen(j + 16 * v), _mm512_mul_ps(x, log2e));
      sum = _mm512_add_ps(sum, e[v]);
      e_high[v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(e[v]), truncate));
    }
    _mm512_storeu_si512(high + j, (__m512i)_mm512_cvtne2ps_pbh(e_high[1], e_high[0]));
    _mm512_storeu_si512(low + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(e[1], e_high[1]),
                                                                _mm512_sub_ps(e[0], e_high[0])));
  }
  const float rescale = std::exp(was - now);
  top_of = now;
  sum_of = sum_of * rescale + _mm512_reduce_add_ps(sum);
  if (rescale != 1.0f) {
    for (int64_t d = 0; d < dim; d += 16) {
      _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(rescale)));
    }
  }
}

// acc [16 lanes] += a row's weights (high and low halves, at keys j and j + 1) times V's pair of rows
// (value: the 16 columns' pairs), as both products take them.
DOT_BF16_TARGET inline __m512 add_pair(__m512 acc, const uint16_t* high, const uint16_t* low, __m512bh value) {
  return _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc, broadcast_pair(high), value), broadcast_pair(low), value);
}
#endif

}  // namespace pagedserve::attention
