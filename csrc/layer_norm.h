// LayerNorm op family: declarations shared by the CPU (.cpp) and CUDA (.cu) kernels.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace fastlayers {

// input viewed as [rows, cols], cols = prod(normalized_shape).
struct RowsCols {
  int64_t rows;
  int64_t cols;
};

// Validates the forward arguments (naming the bad one) and returns the row view.
RowsCols check_layer_norm_args(const at::Tensor& input, at::IntArrayRef normalized_shape,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias,
                               std::optional<at::ScalarType> out_dtype);

// Validates the backward arguments against the forward ones.
RowsCols check_layer_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                        const at::Tensor& mean, const at::Tensor& rstd,
                                        at::IntArrayRef normalized_shape,
                                        const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias);

using LayerNormOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Uninitialised (y, mean, rstd): y like input in out_dtype (default: input's dtype), mean and
// rstd float32 over the input's leading (non-normalized) dimensions.
LayerNormOutputs empty_forward_outputs(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                       std::optional<at::ScalarType> out_dtype);

// Calls fastlayers::layer_norm_fwd through the dispatcher (unboxed) and returns y.
at::Tensor layer_norm_eager(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps);

LayerNormOutputs layer_norm_fwd_cuda(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias, double eps,
                                     std::optional<at::ScalarType> out_dtype);

LayerNormOutputs layer_norm_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                                     const at::Tensor& mean, const at::Tensor& rstd,
                                     at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias,
                                     std::array<bool, 3> output_mask);

}  // namespace fastlayers
