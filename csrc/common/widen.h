// A 16-bit gradient widened to float32 in one vectorized pass: what at::Tensor::to(kFloat) gives
// (every bfloat16 and float16 value is exact in float32), in about the time of a copy. ATen's
// dtype-converting copy from a 16-bit type runs its unrolled, element-at-a-time kernel
// (benchmarks/RESULTS.md "Today's decoders"), and autocast's conversion nodes run it once per
// use in every backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <optional>

namespace fastlayers {

// g.to(kFloat) by widen_cuda.cu's kernel, on g's device and current stream (a new contiguous
// tensor), for a plain contiguous bfloat16 / float16 CUDA tensor holding its values in its
// storage; none otherwise (the caller then converts ATen's way): not CUDA, another dtype, not
// contiguous, a subclass, a batched gradient (autograd.grad's is_grads_batched), a functorch
// wrapper, a zero tensor or a lazily negated view, and any call under a dispatch mode, which
// must see the conversion. Defined in CUDA builds only: include under FASTLAYERS_WITH_CUDA.
std::optional<at::Tensor> widen_to_float(const at::Tensor& g);

// sum += g.to(kFloat) in place on g's device's current stream, in one pass (the engine's own
// addition of the widened gradient: sum + float(g), the same bits), where g is widen_to_float's
// kind and sum a contiguous float32 tensor of g's shape on its device; false (nothing done)
// otherwise.
bool add_widened(const at::Tensor& sum, const at::Tensor& g);

// The stream widen_to_float and add_widened would run on for g (its device's current stream);
// none where g is not widen_to_float's kind or that stream is capturing a CUDA graph.
std::optional<c10::Stream> widening_stream(const at::Tensor& g);

}  // namespace fastlayers
