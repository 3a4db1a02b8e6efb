// sm_90a Linear + activation family, the fused forward GEMM y = act(x . W^T + bias), bf16, w [n,
// k]: one instantiation file per (pass, dtype, layout), so that the build compiles them in
// parallel.
#include "linear_act_sm90.h"
#if FASTLAYERS_WITH_CUTLASS_SM90
#include "linear_act_sm90.cuh"
#endif

namespace fastlayers::sm90 {
FASTLAYERS_SM90_LAUNCHER(launcher_bf16_n, cutlass::bfloat16_t, false, Pass::kForward)
}  // namespace fastlayers::sm90
