// One dtype conversion of an activation shared by several consumers, with native's gradients.
#pragma once

#include <ATen/ATen.h>

namespace fastlayers {

// One use of `converted` (x converted to another dtype once, by the caller): a tensor sharing
// its storage, the output of an autograd node of its own whose backward hands x's producer
// grad.to(x.dtype), as autocast's conversion node (ToCopyBackward0) does. Called at each use,
// where autocast would convert x, so the nodes are created in native's order and the autograd
// engine adds the uses' gradients exactly as it adds native's (see shared_cast.cpp).
at::Tensor converted_use(const at::Tensor& x, const at::Tensor& converted);

}  // namespace fastlayers
