// Dispatch over the compiled sm_80 Linear + activation GEMMs (the generated linear_act_sm80_*.cu):
// the (dtype, weight layout, tile configuration) instantiation; size_rule.cpp picks the
// configuration. No CUTLASS here.
#include "linear_act/sm80/linear_act_sm80.h"

#include <cstdint>

namespace fastlayers {
namespace sm80 {

namespace {

Launcher launcher(Dtype dtype, bool w_transposed, Config config) {
  if (dtype == Dtype::kBFloat16)
    return w_transposed ? launcher_bf16_t(config) : launcher_bf16_n(config);
  return w_transposed ? launcher_fp16_t(config) : launcher_fp16_n(config);
}

Launcher resolve(Dtype dtype, const Problem& p, Config config, const Gpu& gpu) {
  if (config == Config::kAuto) config = choose_config(p.m, p.n, p.k, gpu);
  return launcher(dtype, p.w_transposed, config);
}

}  // namespace

bool kernels_built() { return FASTLAYERS_WITH_CUTLASS_SM80 != 0; }

bool config_available(Dtype dtype, bool w_transposed, Config config) {
  if (config == Config::kAuto) return kernels_built();
  return launcher(dtype, w_transposed, config).run != nullptr;
}

size_t workspace_bytes(Dtype dtype, const Problem& p, Config config, const Gpu& gpu) {
  const Launcher l = resolve(dtype, p, config, gpu);
  return l.workspace_bytes ? l.workspace_bytes(p) : 0;
}

const char* run(Dtype dtype, const Problem& p, Config config, const Gpu& gpu, void* workspace,
                Stream stream) {
  const Launcher l = resolve(dtype, p, config, gpu);
  if (l.run == nullptr) return "this sm80 kernel configuration is not compiled in";
  return l.run(p, workspace, stream);
}

}  // namespace sm80
}  // namespace fastlayers
