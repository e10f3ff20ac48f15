// The CPU ops as one Python module (pagedserve/kernels/cpu_backend.py builds and loads it).

#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                           std::optional<torch::Tensor> sinks, bool dot_bf16);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor query_start, double scale, int64_t window,
                            double softcap, std::optional<torch::Tensor> sinks, bool amx);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                   std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                                                torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> scale,
                            std::optional<torch::Tensor> bias);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> scale,
                            std::optional<torch::Tensor> w_sums, std::optional<torch::Tensor> bias,
                            int64_t n_len, bool amx, bool gated);
int64_t packed_float_group();
torch::Tensor packed_float_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias,
                                  int64_t n_len, bool gated);
torch::Tensor moe(torch::Tensor x, torch::Tensor router, std::optional<torch::Tensor> router_bias,
                  torch::Tensor gate_up, std::optional<torch::Tensor> gate_up_bias, torch::Tensor down,
                  std::optional<torch::Tensor> down_bias, int64_t top_k, bool renormalize, bool softmax_of_top,
                  double swiglu_limit, double swiglu_alpha);

bool probe_feature(const std::string& feature);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over the pool's pages");
  m.def("paged_prefill", &paged_prefill, "paged prefill attention of chunks over their cached prefix and themselves");
  m.def("rms_norm", &rms_norm, "RMSNorm, after adding the residual where one is given");
  m.def("rotary", &rotary, "half-split rotary embedding of q and k, in place");
  m.def("skinny_linear", &skinny_linear, "x W^T * scale (+ bias) for a few rows of x, streaming W once");
  m.def("packed_linear", &packed_linear,
        "x W^T * scale (+ bias) with W packed for vdpbf16ps or vpdpbusd; gated, silu(gate) * up of W's halves");
  m.def("packed_float_group", &packed_float_group, "the output rows a group of packed_float_linear's W packs");
  m.def("packed_float_linear", &packed_float_linear,
        "x W^T (+ bias) in float32 with W packed [K, group] a group; gated, silu(gate) * up of W's halves");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [T, 2I] projection");
  m.def("probe_feature", &probe_feature, "runs one instruction of a CPU feature: whether it gave the right answer");
  m.def("moe", &moe, "a mixture of experts, each chosen expert run once for its tokens");
}
