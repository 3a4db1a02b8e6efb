// sm_90a backward GEMM of the Linear + activation family (dz = act'(saved) * (dy . W^T) in the
// epilogue), fp16, w stored [k, n]: one instantiation file per (pass, dtype,
// layout), so that they compile in parallel. Empty unless the build targets sm_90a with CUTLASS
// headers.
#include "linear_act_sm90.h"
#if FASTLAYERS_WITH_CUTLASS_SM90
#include "linear_act_sm90.cuh"
#endif

namespace fastlayers {
namespace sm90 {

Launcher dgrad_launcher_fp16_t(Config config) {
#if FASTLAYERS_WITH_CUTLASS_SM90
  return launcher_for<cutlass::half_t, true, Pass::kDgrad>(config);
#else
  (void)config;
  return {};
#endif
}

}  // namespace sm90
}  // namespace fastlayers
