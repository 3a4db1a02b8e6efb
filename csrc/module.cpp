// The Python module fastlayers._C. Importing it runs the static op registrations of every
// op family (TORCH_LIBRARY_FRAGMENT in each .cpp/.cu); it also reports how it was built, and
// offers direct (unboxed) entry points for the eager hot path of the layers.
#include <torch/extension.h>
#include <torch/library.h>

#ifndef FASTLAYERS_WITH_CUDA
#define FASTLAYERS_WITH_CUDA 0
#endif

#include "common/arch_check.h"
#include "common/shared_cast.h"
#include "gated_act/gated_act.h"
#include "rotary/rotary.h"
#include "layer_norm/layer_norm.h"
#include "relu_scale/relu_scale.h"
#include "rms_norm/rms_norm.h"
#include "linear_act/linear_act.h"
#include "linear_act/sm80/linear_act_sm80.h"
#include "linear_act/sm90/linear_act_sm90.h"
#ifndef FASTLAYERS_TORCH_MAJOR  // the torch this was compiled against (set by setup.py)
#define FASTLAYERS_TORCH_MAJOR 0
#define FASTLAYERS_TORCH_MINOR 0
#endif
#ifndef FASTLAYERS_CUDA_ARCHS  // comma-separated compute capabilities, e.g. 80,90
#define FASTLAYERS_CUDA_ARCHS
#endif
#ifndef FASTLAYERS_CUDA_PTX_ARCHS  // those of them embedded as PTX too, e.g. 80
#define FASTLAYERS_CUDA_PTX_ARCHS
#endif

// Owns the namespace; each op family adds its ops with TORCH_LIBRARY_FRAGMENT.
TORCH_LIBRARY(fastlayers, m) {}

namespace fastlayers {
// Defined in testing.cpp: the _C._testing submodule's entries.
void register_testing(pybind11::module_ m);
// Defined in dropout_add_layer_norm.cpp: (y, sum) of dropout_add_layer_norm_fwd, called through
// the dispatcher (the _C.dropout_add_layer_norm fast path below).
std::tuple<at::Tensor, at::Tensor> dropout_add_layer_norm_eager(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double p, bool training, bool store_sum);
}  // namespace fastlayers

namespace {

template <size_t N>
pybind11::list arch_list(const int (&archs)[N]) {  // archs[0] is a placeholder
  pybind11::list out;
  for (size_t i = 1; i < N; ++i) out.append(archs[i]);
  return out;
}

pybind11::dict build_info() {
  static const int archs[] = {0, FASTLAYERS_CUDA_ARCHS};
  static const int ptx_archs[] = {0, FASTLAYERS_CUDA_PTX_ARCHS};
  pybind11::dict info;
  info["cuda"] = static_cast<bool>(FASTLAYERS_WITH_CUDA);
  info["cuda_archs"] = arch_list(archs);
  info["cuda_ptx_archs"] = arch_list(ptx_archs);
#if FASTLAYERS_WITH_CUDA
  info["cutlass_sm90"] = fastlayers::sm90::kernels_built();
  info["cutlass_sm80"] = fastlayers::sm80::kernels_built();
#else
  info["cutlass_sm90"] = false;
  info["cutlass_sm80"] = false;
#endif
  info["torch_version"] = pybind11::make_tuple(FASTLAYERS_TORCH_MAJOR, FASTLAYERS_TORCH_MINOR);
  return info;
}

// The fused GEMMs' rules in words, from the C++ that applies them (python -m fastlayers env).
pybind11::dict path_rules() {
  using fastlayers::sm90::Fallback;
  pybind11::dict rules;
  rules["fused_gemm_inputs"] = fastlayers::kFusedGemmInputs;
  rules["sm90_forward"] = fastlayers::sm90::size_rule_text(Fallback::kGemmAndPass);
  rules["sm90_relu_bias"] = fastlayers::sm90::size_rule_text(Fallback::kOneKernel);
  rules["sm90_backward"] = fastlayers::sm90::size_rule_text(Fallback::kGemmAndGradPass);
  rules["sm80_forward"] = fastlayers::sm80::size_rule_text();
  return rules;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastlayers compiled ops";
  m.def("build_info", &build_info,
        "How this extension was built: {'cuda': bool, 'cuda_archs': [80, 90, ...], "
        "'cutlass_sm90': bool (the fused sm_90a GEMM kernels), 'cutlass_sm80': bool (the fused "
        "sm_80 GEMM kernels), 'torch_version': (major, minor)}.");
  m.def("path_rules", &path_rules,
        "Which calls the fused GEMMs take, in words: {'fused_gemm_inputs': what every fused GEMM "
        "call needs, 'sm90_forward', 'sm90_relu_bias' (ReLU with a bias, against cuBLASLt's "
        "one-kernel epilogue), 'sm90_backward' (the MLP's backward GEMM), 'sm80_forward': the "
        "sizes each takes}.");
  // The same op as torch.ops.fastlayers.layer_norm_fwd (same dispatch, autograd, autocast),
  // called without the boxed Python op path: eager nn.Module calls cost no more host time
  // than torch.nn.LayerNorm's.
  // Without the GIL, as torch's own ops run: other Python threads go on during the call.
  m.def("layer_norm", &fastlayers::layer_norm_eager, "y of layer_norm_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &fastlayers::rms_norm_eager, "y of rms_norm_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &fastlayers::add_rms_norm_eager,
        "(y, sum) of add_rms_norm_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dropout_add_layer_norm", &fastlayers::dropout_add_layer_norm_eager,
        "(y, sum) of dropout_add_layer_norm_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_act", &fastlayers::linear_act_eager, "y of linear_act_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("relu_scale", &fastlayers::relu_scale_eager, "relu_scale, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gated_act", &fastlayers::gated_act_eager, "gated_act_fwd (act(gate) * up), unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gated_act_linear", &fastlayers::gated_act_linear_eager,
        "gated_act_linear (act(gate) * (input . weight^T), inference), unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gated_act_down", &fastlayers::gated_act_down_eager,
        "gated_act_down (linear(act(gate) * up, weight, bias), the product recomputed in "
        "backward), unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary", &fastlayers::rotary_eager, "(q_out, k_out) of rotary_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_act_linear", &fastlayers::linear_act_linear_eager,
        "y of linear_act_linear, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("autocast_conversion", &fastlayers::autocast_conversion,
        "x converted to the dtype autocast gives F.linear, with no autograd history, or None "
        "where autocast leaves x as it is or converts it once itself (a leaf requiring grad)",
        pybind11::arg("x"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("converted_use", &fastlayers::converted_use,
        "One use of `converted` (x converted to another dtype once): its storage, as the "
        "output of a node of its own whose backward gives x grad.to(x.dtype), as autocast's "
        "conversion does",
        pybind11::arg("x"), pybind11::arg("converted"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("kernels_run_on",
#if FASTLAYERS_WITH_CUDA
        &fastlayers::kernels_run_on,
#else
        [](int) { return false; },  // a CPU-only build has no CUDA kernels at all
#endif
        "Whether this build's CUDA kernels run on CUDA device `device_index` (probed once per "
        "device, then cached).",
        pybind11::arg("device_index"));
  m.def("_arch_mismatch_message", &fastlayers::arch_mismatch_message,
        "The error a CUDA call raises on a GPU this build has no kernels for (major, minor, "
        "name); for tests.");
#if FASTLAYERS_WITH_CUDA
  m.def("linear_act_path", &fastlayers::linear_act_cuda_path,
        "Which CUDA path linear_act takes for these arguments: 'cutlass_sm90', "
        "'cutlass_sm80' or 'fallback: <why>'.");
  m.def("linear_act_dgrad_path", &fastlayers::linear_act_dgrad_cuda_path,
        "Which CUDA path linear_act_dgrad (the MLP backward's fused GEMM) takes for these "
        "arguments: 'cutlass_sm90' or 'fallback: <why>'.");
  m.def("gated_act_linear_path", &fastlayers::gated_act_linear_cuda_path,
        "Which CUDA path gated_act_linear takes for these arguments (gate, input, weight, "
        "activation): 'cutlass_sm90' or 'fallback: <why>'.");
#endif
  // Test and tuning entries (raw kernels, size rules for any GPU, Philox words): their own
  // submodule, out of the product's namespace.
  fastlayers::register_testing(m.def_submodule(
      "_testing", "Entries for tests, benchmarks and tuning; not part of fastlayers' API."));
}
