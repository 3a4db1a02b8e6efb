// sm_90a Linear + activation family, the MLP's forward that keeps act'(z) for its backward
// GEMM, bf16, w stored [k, n]: one instantiation file per (pass, dtype, layout), so that the build
// compiles them in parallel.
#include "linear_act_sm90.h"
#if FASTLAYERS_WITH_CUTLASS_SM90
#include "linear_act_sm90.cuh"
#endif

namespace fastlayers::sm90 {
FASTLAYERS_SM90_LAUNCHER(keep_launcher_bf16_t, cutlass::bfloat16_t, true,
                         Pass::kForwardKeepDerivative)
}  // namespace fastlayers::sm90
