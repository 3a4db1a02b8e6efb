// The submodule fastlayers._C._testing: entries for tests, benchmarks and tuning (raw kernels with
// a forced tile config or epilogue, the size rules evaluated for any GPU, Philox's words, the
// sm90 tile configs by number). Kept out of the product module so that its namespace is the
// package's API.
#include <torch/extension.h>

#ifndef FASTLAYERS_WITH_CUDA
#define FASTLAYERS_WITH_CUDA 0
#endif

#include <map>
#include <string>

#include "common/philox.h"
#include "linear_act/linear_act.h"
#include "linear_act/sm80/linear_act_sm80.h"
#include "linear_act/sm90/linear_act_sm90.h"

namespace fastlayers {

namespace {

// number -> name of each compiled-in tile config of a family (Config and config_name of
// linear_act_sm90.h / linear_act_sm80.h).
template <typename Config>
std::map<int, std::string> config_names(int count, const char* (*name)(Config)) {
  std::map<int, std::string> out;
  for (int i = 0; i < count; ++i) out[i] = name(static_cast<Config>(i));
  return out;
}

}  // namespace

void register_testing(pybind11::module_ m) {
  m.def(
      "sm90_tile_configs",
      [] { return config_names<sm90::Config>(sm90::kNumConfigs, &sm90::config_name); },
      "The sm90 kernels' tile configs: {number the raw entries take: name}.");
  m.def(
      "sm80_tile_configs",
      [] { return config_names<sm80::Config>(sm80::kNumConfigs, &sm80::config_name); },
      "The sm80 kernels' tile configs: {number the raw entries take: name}.");
  m.def(
      "philox_random4",
      [](uint64_t seed, uint64_t offset, uint64_t group) {
        const fastlayers::philox::Words r = fastlayers::philox::random4(seed, offset, group);
        return std::vector<uint32_t>(r.w, r.w + 4);
      },
      "The 4 Philox4x32-10 words of counter group `group` for (seed, offset) (csrc/common/philox.h); "
      "for tests.",
      pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("group"));
  m.def(
      "sm90_tile_config",
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
      "sm90_size_refusal",
      [](int64_t m, int64_t n, int64_t k, int sm_count,
         int fallback) -> std::optional<std::string> {
        TORCH_CHECK(fallback >= 0 && fallback <= 2, "sm90_size_refusal: fallback must be 0..2");
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
      "sm80_tile_config",
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
      "sm80_size_refusal",
      [](int64_t m, int64_t n, int64_t k, int sm_count) -> std::optional<std::string> {
        const char* why = fastlayers::sm80::size_refusal(m, n, k, sm_count);
        return why ? std::optional<std::string>(why) : std::nullopt;
      },
      "Why an 8.x GPU's default path keeps such a problem off the sm80 kernel (None: it takes "
      "it); for tests.",
      pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("sm_count"));
#if FASTLAYERS_WITH_CUDA
  m.def("linear_act_dgrad_sm90_raw", &fastlayers::linear_act_dgrad_sm90_raw,
        "Benchmarks and tuning: the sm90 backward GEMM dz = act'(saved) * (grad_out . W2) with a "
        "given epilogue (0 erf, 1 tanh, 2 relu, 3 identity, 4 saved derivative: dz = saved * "
        "(grad_out . W2)) and tile config (-1 auto); with "
        "want_db, also the bias gradient (dz's column sums from the epilogue), returned (else "
        "an empty tensor).",
        pybind11::arg("grad_out"), pybind11::arg("weight"), pybind11::arg("saved"),
        pybind11::arg("dz"), pybind11::arg("weight_transposed"), pybind11::arg("epilogue"),
        pybind11::arg("config"), pybind11::arg("want_db") = false);
  m.def(
      "linear_act_keeps_derivative",
      [](const at::Tensor& input, const at::Tensor& weight, bool has_bias,
         c10::string_view activation, bool weight_transposed) {
        return fastlayers::linear_act_keeps_derivative(
            input, weight, has_bias, fastlayers::parse_activation(activation), weight_transposed);
      },
      "Whether linear_act_linear's forward keeps act'(z) rather than z for its backward (where "
      "the sm90 forward kernel computes it beside act(z)); for tests.",
      pybind11::arg("input"), pybind11::arg("weight"), pybind11::arg("has_bias"),
      pybind11::arg("activation"), pybind11::arg("weight_transposed"));
  m.def("linear_act_dgrad_fallback_raw", &fastlayers::linear_act_dgrad_fallback_raw,
        "Benchmarks and tuning: linear_act_dgrad's fallback (cuBLAS dy . W2, then the backward "
        "pass writing dz and db) with a given epilogue (0 erf, 1 tanh, 2 relu): (dz, db).");
  m.def("linear_act_sm90_raw", &fastlayers::linear_act_sm90_raw,
        "Benchmarks and tuning: the sm90 kernel with a given epilogue (0 erf, 1 tanh, 2 relu, "
        "3 identity) and tile config (-1 auto) on 2-D contiguous tensors.");
  m.def("linear_act_sm80_raw", &fastlayers::linear_act_sm80_raw,
        "Benchmarks and tests: the sm80 kernel (CUTLASS 2.x, mma.sync; any GPU from compute "
        "capability 8.0 on) with a given epilogue (0 erf, 1 tanh, 2 relu, 3 identity) and tile "
        "config (-1 auto, 0 128x256, 1 128x128, 2 64x64) on 2-D contiguous tensors.");
#endif
}

}  // namespace fastlayers
