// A 16-bit gradient widened to float32 in one vectorized pass: what at::Tensor::to(kFloat) gives
// (every bfloat16 and float16 value is exact in float32), in about the time of a copy. ATen's
// dtype-converting copy from a 16-bit type runs its unrolled, element-at-a-time kernel
// (benchmarks/RESULTS.md "Today's decoders"), and autocast's conversion nodes run it once per
// use in every backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastlayers {

// g.to(kFloat) by widen_cuda.cu's kernel, on g's device and current stream (a new contiguous
// tensor), for a plain contiguous bfloat16 / float16 CUDA tensor holding its values in its
// storage; none otherwise (the caller then converts ATen's way): not CUDA, another dtype, not
// contiguous, a subclass, a batched gradient (autograd.grad's is_grads_batched), a functorch
// wrapper, a zero tensor or a lazily negated view, and any call under a dispatch mode, which
// must see the conversion. Defined in CUDA builds only: include under FASTLAYERS_WITH_CUDA.
std::optional<at::Tensor> widen_to_float(const at::Tensor& g);

}  // namespace fastlayers
