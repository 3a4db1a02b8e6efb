// dropout + residual add + LayerNorm op family: declarations shared by the CPU (.cpp) and CUDA
// (.cu) kernels.
//
//   dropout_add_layer_norm_fwd(x, residual?, normalized_shape, weight?, bias?, eps, p, training,
//                              store_sum, out_dtype?) -> (y, sum, mean, rstd, rng_state)
//     d = dropout(x) (kept: x / (1 - p), rounded to x's dtype; dropped: 0; no dropout unless
//         training and p > 0), s = d + residual in S = promote(x, residual) (x's dtype without
//         a residual), y = layer_norm(s) in out_dtype (default S), statistics of the S-rounded s.
//     sum: s (dtype S) when store_sum, else an empty tensor; rng_state: int64 [2] on x's device,
//     (seed, offset) of the Philox stream the mask was drawn from (philox.h; zeros when no
//     dropout): the backward regenerates the mask from it.
//   dropout_add_layer_norm_bwd(grad_y, grad_sum?, sum, mean, rstd, rng_state, normalized_shape,
//                              weight?, bias?, p, dropout, x_dtype, output_mask[4])
//       -> (grad_x, grad_residual, grad_weight, grad_bias)
//     ds = layer_norm_backward(grad_y, s) (rounded to S) + grad_sum (prenorm: the gradient of
//     the returned sum), grad_residual = ds (dtype S), grad_x = mask ? ds / (1 - p) : 0 in
//     x_dtype (ds rounded to x_dtype first, as autograd would hand it to dropout's backward).
//     `dropout` says whether the forward drew a mask (training and p > 0). Outputs not asked for
//     by output_mask (x, residual, weight, bias) are empty tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "layer_norm/layer_norm.h"

namespace fastlayers {

using DropoutAddLayerNormOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using DropoutAddLayerNormGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The sum's dtype: promote(x, residual), or x's dtype without a residual.
at::ScalarType dropout_add_sum_dtype(const at::Tensor& x, const std::optional<at::Tensor>& residual);

// Validates the forward arguments, naming the bad one, and returns the row view of x.
RowsCols check_dropout_add_layer_norm_args(const at::Tensor& x,
                                           const std::optional<at::Tensor>& residual,
                                           at::IntArrayRef normalized_shape,
                                           const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& bias, double p,
                                           std::optional<at::ScalarType> out_dtype);

// Whether this call drops anything (draws random numbers): training and p > 0.
inline bool dropout_active(double p, bool training) { return training && p > 0.0; }

DropoutAddLayerNormOutputs dropout_add_layer_norm_fwd_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double p, bool training, bool store_sum,
    std::optional<at::ScalarType> out_dtype);

DropoutAddLayerNormGrads dropout_add_layer_norm_bwd_cuda(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng_state,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double p, bool dropout, at::ScalarType x_dtype,
    std::array<bool, 4> output_mask);

}  // namespace fastlayers
