// A mixture of experts on the CPU: x [T, H] routed to each token's top_k of E experts, and the weighted sum
// of their gated MLPs (`KernelBackend.moe`, whose torch reference this follows), float32 or bfloat16; the
// router's softmax in float32.
//
// The tokens are grouped by expert, and each chosen expert runs once for all the tokens routed to it, so
// that its weights are read once a step: through skinny_linear, which streams them at memory speed, for the
// few rows of a decode step, and through MKL for more. No Python runs between the experts.

#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros_like.h>

#include <optional>

#include "checks.h"

at::Tensor skinny_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> scale,
                         std::optional<at::Tensor> bias);

namespace {

constexpr int64_t kSkinnyRows = 16;  // pagedserve/kernels/cpu_backend.py's SKINNY_ROWS

using pagedserve::check_contiguous, pagedserve::check_cpu, pagedserve::check_cpu_float, pagedserve::check_shape,
    pagedserve::kAny;

void check_bias(const std::optional<at::Tensor>& bias, const char* name, std::initializer_list<int64_t> sizes,
                const char* spelled, at::ScalarType dtype) {
  if (!bias) return;
  check_cpu(*bias, name, dtype);
  check_shape(*bias, name, sizes, spelled);
  check_contiguous(*bias, name);
}

at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return x.size(0) <= kSkinnyRows ? skinny_linear(x, weight, std::nullopt, bias) : at::linear(x, weight, bias);
}

std::optional<at::Tensor> row(const std::optional<at::Tensor>& bias, int64_t expert) {
  return bias ? std::optional<at::Tensor>(bias->select(0, expert)) : std::nullopt;
}

}  // namespace

at::Tensor moe(at::Tensor x, at::Tensor router, std::optional<at::Tensor> router_bias, at::Tensor gate_up,
               std::optional<at::Tensor> gate_up_bias, at::Tensor down, std::optional<at::Tensor> down_bias,
               int64_t top_k, bool renormalize, bool softmax_of_top, double swiglu_limit, double swiglu_alpha) {
  check_cpu_float(x, "x");
  const auto dtype = x.scalar_type();
  check_shape(x, "x", {kAny, kAny}, "[T, H]");
  check_contiguous(x, "x");
  const int64_t hidden = x.size(1);
  check_cpu(router, "router", dtype);
  check_shape(router, "router", {kAny, hidden}, "[E, H]");
  const int64_t experts = router.size(0);
  check_cpu(gate_up, "gate_up", dtype);
  check_shape(gate_up, "gate_up", {experts, kAny, hidden}, "[E, 2 I, H]");
  check_contiguous(gate_up, "gate_up");
  const int64_t inner = gate_up.size(1) / 2;
  TORCH_CHECK_VALUE(gate_up.size(1) == 2 * inner, "gate_up must have an even number of rows, not ", gate_up.size(1));
  check_cpu(down, "down", dtype);
  check_shape(down, "down", {experts, hidden, inner}, "[E, H, I]");
  check_contiguous(down, "down");
  check_bias(router_bias, "router_bias", {experts}, "[E]", dtype);
  check_bias(gate_up_bias, "gate_up_bias", {experts, 2 * inner}, "[E, 2 I]", dtype);
  check_bias(down_bias, "down_bias", {experts, hidden}, "[E, H]", dtype);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= experts, "top_k must be 1..", experts, ", not ", top_k);

  const auto logits = at::linear(x, router, router_bias).to(at::kFloat);
  at::Tensor weights, chosen;
  if (softmax_of_top) {
    std::tie(weights, chosen) = logits.topk(top_k, -1);
    weights = weights.softmax(-1);
  } else {
    std::tie(weights, chosen) = logits.softmax(-1).topk(top_k, -1);
    if (renormalize) weights = weights / weights.sum(-1, true);
  }
  const auto flat = chosen.flatten();
  const auto flat_weights = weights.flatten();
  // (token, slot) pairs grouped by expert, each group in token order
  const auto order = std::get<1>(flat.sort(std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  const auto counts = at::bincount(flat, {}, experts);
  const int64_t* count_of = counts.data_ptr<int64_t>();
  auto out = at::zeros_like(x);
  const float limit = static_cast<float>(swiglu_limit);
  for (int64_t expert = 0, start = 0; expert < experts; start += count_of[expert], ++expert) {
    if (count_of[expert] == 0) continue;
    const auto pairs = order.narrow(0, start, count_of[expert]);
    const auto tokens = pairs.div(top_k, "floor");
    const auto both = expert_linear(x.index_select(0, tokens), gate_up[expert], row(gate_up_bias, expert));
    auto gate = both.narrow(1, 0, inner);
    const auto up = both.narrow(1, inner, inner);
    at::Tensor gated;
    if (limit > 0.0f) {
      gate = gate.clamp_max(limit);
      gated = gate * (gate * swiglu_alpha).sigmoid() * (up.clamp(-limit, limit) + 1);
    } else {
      gated = at::silu(gate) * up;
    }
    const auto y = expert_linear(gated.contiguous(), down[expert], row(down_bias, expert));
    out.index_add_(0, tokens, (y * flat_weights.index_select(0, pairs).unsqueeze(1)).to(dtype));
  }
  return out;
}
