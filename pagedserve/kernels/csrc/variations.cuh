// What a layer's attention may add to softmax(q k^T scale) v (kernels.LayerAttention), shared by the paged
// attention kernels: a sliding window, a soft cap on the scores (Gemma 2), and a sink logit per query head in
// the softmax's denominator (gpt-oss). A window of 0, a softcap of 0 and null sinks are plain attention.

#define LN2 0.6931471805599453f
#define LOG2E 1.4426950408889634f

// The first key a query at position pos sees.
__device__ __forceinline__ int window_start(int pos, int window) { return window > 0 ? max(0, pos - window + 1) : 0; }

// A scaled score, soft-capped: softcap tanh(score / softcap).
__device__ __forceinline__ float capped(float score, float softcap) {
  return softcap > 0.f ? softcap * tanhf(score / softcap) : score;
}

// The softmax's denominator with query head `head`'s sink beside the keys, whose weights sum to `sum` after
// subtracting `max` (natural-log units): both rescaled to the larger of max and the sink. rescale gets the
// factor the output's numerator, taken at the same max, must be multiplied by too.
__device__ __forceinline__ float with_sink(float sum, float max, const scalar_t* sinks, int head, float& rescale) {
  rescale = 1.f;
  if (sinks == nullptr) return sum;
  const float sink = to_float(sinks[head]), top = fmaxf(max, sink);
  rescale = __expf(max - top);
  return sum * rescale + __expf(sink - top);
}
