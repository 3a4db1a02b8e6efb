// One dtype conversion of an activation shared by several consumers, with native's gradients.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastlayers {

// x converted to the dtype autocast gives the Linears that read it, recording no autograd
// history (each reader takes it through converted_use); none where autocast leaves x as it is
// (no autocast for x's device type, x not floating point, float64, or already that dtype) or
// converts it once itself (a leaf that requires grad: autocast's cache).
std::optional<at::Tensor> autocast_conversion(const at::Tensor& x);

// One use of `converted` (x converted to another dtype once, by the caller): a tensor sharing
// its storage, the output of an autograd node of its own whose backward hands x's producer
// grad.to(x.dtype), as autocast's conversion node (ToCopyBackward0) does. Called at each use,
// where autocast would convert x, so the nodes are created in native's order and the autograd
// engine adds the uses' gradients exactly as it adds native's (see shared_cast.cpp).
at::Tensor converted_use(const at::Tensor& x, const at::Tensor& converted);

}  // namespace fastlayers
