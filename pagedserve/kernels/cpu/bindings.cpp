// The CPU ops as one Python module (pagedserve/kernels/cpu_backend.py builds and loads it).

// torch's pybind11 casters for at::Tensor alone: torch/extension.h brings torch's whole C++ API too, which
// took most of a minute of every source's compile (the ops themselves include only the ATen headers they use).
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>

at::Tensor paged_decode(at::Tensor q, at::Tensor kv_layer, at::Tensor block_tables, at::Tensor seq_lens, double scale,
                        int64_t window, double softcap, std::optional<at::Tensor> sinks, bool dot_bf16);
at::Tensor paged_prefill(at::Tensor q, at::Tensor kv_layer, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor query_start, double scale, int64_t window, double softcap,
                         std::optional<at::Tensor> sinks, bool dot_bf16, bool amx);
void write_kv(at::Tensor kv_layer, at::Tensor k, at::Tensor v, at::Tensor slot_mapping);
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                            std::optional<at::Tensor> residual);
std::tuple<at::Tensor, at::Tensor> rotary(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor skinny_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> scale,
                         std::optional<at::Tensor> bias);
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> scale,
                         std::optional<at::Tensor> w_sums, std::optional<at::Tensor> bias, int64_t n_len, bool amx,
                         bool gated);
int64_t packed_float_group();
at::Tensor packed_float_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias, int64_t n_len,
                               bool gated);
at::Tensor moe(at::Tensor x, at::Tensor router, std::optional<at::Tensor> router_bias, at::Tensor gate_up,
               std::optional<at::Tensor> gate_up_bias, at::Tensor down, std::optional<at::Tensor> down_bias,
               int64_t top_k, bool renormalize, bool softmax_of_top, double swiglu_limit, double swiglu_alpha);

bool probe_feature(const std::string& feature);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over the pool's pages");
  m.def("paged_prefill", &paged_prefill, "paged prefill attention of chunks over their cached prefix and themselves");
  m.def("write_kv", &write_kv, "a step's keys and values into their slots of the pool");
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
