// sm_90a fused Linear + activation kernels, fp16, w stored transposed ([k, n]): one
// instantiation file per (dtype, layout), so that they compile in parallel. Empty unless the
// build targets sm_90a with CUTLASS headers.
#include "linear_act_sm90.h"
#if FASTLAYERS_WITH_CUTLASS_SM90
#include "linear_act_sm90.cuh"
#endif

namespace fastlayers {
namespace sm90 {

Launcher launcher_fp16_t(Config config) {
#if FASTLAYERS_WITH_CUTLASS_SM90
  return launcher_for<cutlass::half_t, true, Pass::kForward>(config);
#else
  (void)config;
  return {};
#endif
}

}  // namespace sm90
}  // namespace fastlayers
