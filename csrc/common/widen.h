// A 16-bit gradient widened to float32 in one vectorized pass: what at::Tensor::to(kFloat) gives
// (every bfloat16 and float16 value is exact in float32), in about the time of a copy. ATen's
// dtype-converting copy from a 16-bit type runs its unrolled, element-at-a-time kernel
// (benchmarks/RESULTS.md "Today's decoders"), and autocast's conversion nodes run it once per
// use in every backward.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fastlayers {

// dst[i] = float(src[i]) for i < n on `stream`, over at most 8 blocks an SM of the device's
// `sm_count`: src holds bfloat16 (`bf16`) or float16 values (widen_cuda.cu; shared_cast.cpp
// holds the tensor-level entry).
void launch_widen_to_float(const void* src, bool bf16, float* dst, int64_t n, int sm_count,
                           cudaStream_t stream);

}  // namespace fastlayers
