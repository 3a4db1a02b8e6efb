// The Python module fastlayers._C. Importing it runs the static op registrations of every
// op family (TORCH_LIBRARY_FRAGMENT in each .cpp/.cu); it also reports how it was built, and
// offers direct (unboxed) entry points for the eager hot path of the layers.
#include <torch/extension.h>
#include <torch/library.h>

#ifndef FASTLAYERS_WITH_CUDA
#define FASTLAYERS_WITH_CUDA 0
#endif

#include "arch_check.h"
#include "layer_norm.h"
#include "relu_scale.h"
#include "linear_act.h"
#include "philox.h"
#if FASTLAYERS_WITH_CUDA
#include "linear_act_sm80.h"
#include "linear_act_sm90.h"
#endif
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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastlayers compiled ops";
  m.def("build_info", &build_info,
        "How this extension was built: {'cuda': bool, 'cuda_archs': [80, 90, ...], "
        "'cutlass_sm90': bool (the fused sm_90a GEMM kernels), 'cutlass_sm80': bool (the fused "
        "sm_80 GEMM kernels), 'torch_version': (major, minor)}.");
  // The same op as torch.ops.fastlayers.layer_norm_fwd (same dispatch, autograd, autocast),
  // called without the boxed Python op path: eager nn.Module calls cost no more host time
  // than torch.nn.LayerNorm's.
  // Without the GIL, as torch's own ops run: other Python threads go on during the call.
  m.def("layer_norm", &fastlayers::layer_norm_eager, "y of layer_norm_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dropout_add_layer_norm", &fastlayers::dropout_add_layer_norm_eager,
        "(y, sum) of dropout_add_layer_norm_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def(
      "_philox_random4",
      [](uint64_t seed, uint64_t offset, uint64_t group) {
        const fastlayers::philox::Words r = fastlayers::philox::random4(seed, offset, group);
        return std::vector<uint32_t>(r.w, r.w + 4);
      },
      "The 4 Philox4x32-10 words of counter group `group` for (seed, offset) (csrc/philox.h); "
      "for tests.",
      pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("group"));
  m.def("linear_act", &fastlayers::linear_act_eager, "y of linear_act_fwd, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("relu_scale", &fastlayers::relu_scale_eager, "relu_scale, unboxed call",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_act_linear", &fastlayers::linear_act_linear_eager,
        "y of linear_act_linear, unboxed call",
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
  m.def("_linear_act_dgrad_sm90_raw", &fastlayers::linear_act_dgrad_sm90_raw,
        "Benchmarks and tuning: the sm90 backward GEMM dz = act'(saved) * (grad_out . W2) with a "
        "given epilogue (0 erf, 1 tanh, 2 relu, 3 identity, 4 saved derivative: dz = saved * "
        "(grad_out . W2)) and tile config (-1 auto); with "
        "want_db, also the bias gradient (dz's column sums from the epilogue), returned (else "
        "an empty tensor).",
        pybind11::arg("grad_out"), pybind11::arg("weight"), pybind11::arg("saved"),
        pybind11::arg("dz"), pybind11::arg("weight_transposed"), pybind11::arg("epilogue"),
        pybind11::arg("config"), pybind11::arg("want_db") = false);
  m.def(
      "_linear_act_keeps_derivative",
      [](const at::Tensor& input, const at::Tensor& weight, bool has_bias,
         c10::string_view activation, bool weight_transposed) {
        return fastlayers::linear_act_keeps_derivative(
            input, weight, has_bias, fastlayers::parse_activation(activation), weight_transposed);
      },
      "Whether linear_act_linear's forward keeps act'(z) rather than z for its backward (where "
      "the sm90 forward kernel computes it beside act(z)); for tests.",
      pybind11::arg("input"), pybind11::arg("weight"), pybind11::arg("has_bias"),
      pybind11::arg("activation"), pybind11::arg("weight_transposed"));
  m.def("_linear_act_dgrad_fallback_raw", &fastlayers::linear_act_dgrad_fallback_raw,
        "Benchmarks and tuning: linear_act_dgrad's fallback (cuBLAS dy . W2, then the backward "
        "pass writing dz and db) with a given epilogue (0 erf, 1 tanh, 2 relu): (dz, db).");
  m.def("_linear_act_sm90_raw", &fastlayers::linear_act_sm90_raw,
        "Benchmarks and tuning: the sm90 kernel with a given epilogue (0 erf, 1 tanh, 2 relu, "
        "3 identity) and tile config (-1 auto) on 2-D contiguous tensors.");
  m.def(
      "_sm90_tile_config",
      [](int64_t m, int64_t n, int64_t k, int sm_count, bool backward) {
        using fastlayers::sm90::Pass;
        const Pass pass = backward ? Pass::kDgrad : Pass::kForward;
        return static_cast<int>(fastlayers::sm90::auto_config(m, n, k, sm_count, pass));
      },
      "The sm90 tile config (0 coop 256x128, 1 ping-pong 128x128, 2 64x64, 3 128x128 "
      "unclustered) its rule picks for an m x n x k problem (the forward GEMM, or the MLP's "
      "backward GEMM) on a GPU with these SMs; for tests on any machine.",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("sm_count"),
      pybind11::arg("backward") = false);
  m.def(
      "_sm90_size_refusal",
      [](int64_t m, int64_t n, int64_t k, int sm_count,
         int fallback) -> std::optional<std::string> {
        TORCH_CHECK(fallback >= 0 && fallback <= 2, "_sm90_size_refusal: fallback must be 0..2");
        const char* why = fastlayers::sm90::size_refusal(
            m, n, k, sm_count, static_cast<fastlayers::sm90::Fallback>(fallback));
        return why ? std::optional<std::string>(why) : std::nullopt;
      },
      "Why an sm_90 GPU keeps such a problem off the fused kernels, given the fallback (0 GEMM + "
      "activation pass, 1 cuBLASLt's one kernel, 2 GEMM + backward pass; None: it takes it); for "
      "tests on any machine.",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("sm_count"),
      pybind11::arg("fallback"));
  m.def(
      "_sm80_tile_config",
      [](int64_t m, int64_t n, int64_t k, int sm_count, size_t shared_per_block,
         size_t shared_per_sm) {
        const fastlayers::sm80::Gpu gpu{sm_count, shared_per_block, shared_per_sm};
        return static_cast<int>(fastlayers::sm80::choose_config(m, n, k, gpu));
      },
      "The sm80 tile config (0 128x256, 1 128x128, 2 64x64) its rule picks for an m x n x k "
      "problem on a GPU with these SMs and shared memory (bytes); for tests of 8.x GPUs' rules "
      "on any machine.",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("sm_count"),
      pybind11::arg("shared_per_block"), pybind11::arg("shared_per_sm"));
  m.def(
      "_sm80_size_refusal",
      [](int64_t m, int64_t n, int64_t k, int sm_count) -> std::optional<std::string> {
        const char* why = fastlayers::sm80::size_refusal(m, n, k, sm_count);
        return why ? std::optional<std::string>(why) : std::nullopt;
      },
      "Why an 8.x GPU's default path keeps such a problem off the sm80 kernel (None: it takes "
      "it); for tests.",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("sm_count"));
  m.def("_linear_act_sm80_raw", &fastlayers::linear_act_sm80_raw,
        "Benchmarks and tests: the sm80 kernel (CUTLASS 2.x, mma.sync; any GPU from compute "
        "capability 8.0 on) with a given epilogue (0 erf, 1 tanh, 2 relu, 3 identity) and tile "
        "config (-1 auto, 0 128x256, 1 128x128, 2 64x64) on 2-D contiguous tensors.");
#endif
}
