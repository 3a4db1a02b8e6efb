// Dispatch over the compiled sm_90a Linear + activation GEMMs (the generated linear_act_sm90_*.cu):
// the (pass, dtype, weight layout, tile configuration) instantiation; size_rule.cpp picks the
// configuration. No CUTLASS here.
#include "linear_act/sm90/linear_act_sm90.h"

#include <cstdint>

namespace fastlayers {
namespace sm90 {

namespace {

Launcher launcher(Pass pass, Dtype dtype, bool w_transposed, Config config) {
  const bool bf16 = dtype == Dtype::kBFloat16;
  if (pass == Pass::kDgrad) {
    if (bf16) return w_transposed ? dgrad_launcher_bf16_t(config) : dgrad_launcher_bf16_n(config);
    return w_transposed ? dgrad_launcher_fp16_t(config) : dgrad_launcher_fp16_n(config);
  }
  if (pass == Pass::kForwardKeepDerivative) {
    if (bf16) return w_transposed ? keep_launcher_bf16_t(config) : keep_launcher_bf16_n(config);
    return w_transposed ? keep_launcher_fp16_t(config) : keep_launcher_fp16_n(config);
  }
  if (bf16) return w_transposed ? launcher_bf16_t(config) : launcher_bf16_n(config);
  return w_transposed ? launcher_fp16_t(config) : launcher_fp16_n(config);
}

Launcher resolve(Dtype dtype, const Problem& p) {
  return launcher(p.pass, dtype, p.w_transposed,
                  p.config == Config::kAuto ? choose_config(p) : p.config);
}

}  // namespace

bool kernels_built() { return FASTLAYERS_WITH_CUTLASS_SM90 != 0; }

bool config_available(Pass pass, Dtype dtype, bool w_transposed, Config config) {
  if (config == Config::kAuto) return kernels_built();
  return launcher(pass, dtype, w_transposed, config).run != nullptr;
}

size_t workspace_bytes(Dtype dtype, const Problem& p) {
  const Launcher l = resolve(dtype, p);
  return l.workspace_bytes ? l.workspace_bytes(p) : 0;
}

const char* run(Dtype dtype, const Problem& p, void* workspace, Stream stream) {
  const Launcher l = resolve(dtype, p);
  if (l.run == nullptr) return "this sm90 kernel configuration is not compiled in";
  return l.run(p, workspace, stream);
}

}  // namespace sm90
}  // namespace fastlayers
