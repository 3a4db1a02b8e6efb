// One dtype conversion of an activation shared by several consumers, with native's gradient.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace fastlayers {

// `uses` tensors holding x converted to `dtype` once (one storage), each its own output of one
// autograd node, so each consumer's gradient reaches the node separately. Where autocast would
// convert x once per consumer (F.linear of a float32 activation under bfloat16 autocast), this
// gives the same values with one conversion and one saved copy; the backward converts each
// gradient to x's dtype and sums them there, as native's per-use conversions and the autograd
// engine's accumulation do (bit for bit for two uses; see shared_cast.cpp).
std::vector<at::Tensor> shared_cast(const at::Tensor& x, at::ScalarType dtype, int64_t uses);

}  // namespace fastlayers
