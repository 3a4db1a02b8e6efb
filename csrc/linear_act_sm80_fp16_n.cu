// sm_80 Linear + activation family, the fused forward GEMM y = act(x . W^T + bias), fp16, w [n, k]:
// one instantiation file per (dtype, layout), so that the build compiles them in parallel.
#include "linear_act_sm80.h"
#if FASTLAYERS_WITH_CUTLASS_SM80
#include "linear_act_sm80.cuh"
#endif

namespace fastlayers::sm80 {
FASTLAYERS_SM80_LAUNCHER(launcher_fp16_n, cutlass::half_t, false)
}  // namespace fastlayers::sm80
