// sm_80 Linear + activation family, the fused forward GEMM y = act(x . W^T + bias), fp16,
// w stored [k, n]: one instantiation file per (dtype, layout), compiled in parallel.
#include "linear_act_sm80.h"
#if FASTLAYERS_WITH_CUTLASS_SM80
#include "linear_act_sm80.cuh"
#endif

namespace fastlayers::sm80 {
FASTLAYERS_SM80_LAUNCHER(launcher_fp16_t, cutlass::half_t, true)
}  // namespace fastlayers::sm80
