// RMSNorm op family: declarations shared by the CPU/composite (.cpp) and CUDA (.cu) code.
//
// One op computes every RMSNorm the models in use write, each in its own rounding order (the
// `form` argument). With xhat = x * rsqrt(mean(x^2) + eps) in float32 (float64 for float64
// inputs), w the weight:
//
//   kTorch (0)  torch.nn.RMSNorm / F.rms_norm: (xhat * w) in float32, cast to the
//               input's dtype. eps None: torch.finfo(float32).eps (float64's for float64), as
//               torch's implementation does.
//   kCastFirst (1)  LLaMA, Mistral, Qwen2/3, Phi-3 and copies: xhat cast to the input's dtype,
//               then times w (the product in the promoted dtype: a float32 weight with a bf16
//               input gives a float32 output).
//   kT5 (2)     T5LayerNorm (T5, T5 v1.1, mT5, ...): xhat cast to w's dtype when that is half,
//               then times w.
//   kGemma (3)  Gemma 1-3: xhat * (1 + w) in float32, cast to the input's dtype.
//   kFloat32 (4)  OLMo2: kTorch computed in float32 even for float64 inputs (x.to(float32)).
//
// A product of two half values is computed in float32 and rounded once (as ATen's kernels do),
// so each form is: y = round_out(mid(xhat) * (w + offset)); RmsForm in
// layer_norm/layer_norm_kernels.cuh carries mid and offset to the kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace fastlayers {

enum class RmsNormForm : int { kTorch = 0, kCastFirst = 1, kT5 = 2, kGemma = 3, kFloat32 = 4 };

// The validated form (names the argument otherwise).
RmsNormForm rms_norm_form(int64_t form);

// The output dtype of a call (the rules above); out_dtype overrides it (autocast: float32).
at::ScalarType rms_norm_out_dtype(RmsNormForm form, at::ScalarType input,
                                  const std::optional<at::Tensor>& weight,
                                  std::optional<at::ScalarType> out_dtype);

// The dtype xhat is rounded to before the weight, or nullopt (no rounding).
std::optional<at::ScalarType> rms_norm_mid_dtype(RmsNormForm form, at::ScalarType input,
                                                 const std::optional<at::Tensor>& weight);

// eps as the op uses it: the given value, else the float32 (float64 for float64 inputs)
// machine epsilon.
double rms_norm_eps(std::optional<double> eps, at::ScalarType input);

// Checks the forward arguments (naming the bad one); returns {rows, cols}.
std::array<int64_t, 2> check_rms_norm_args(const at::Tensor& input,
                                           at::IntArrayRef normalized_shape,
                                           const std::optional<at::Tensor>& weight, int64_t form,
                                           std::optional<at::ScalarType> out_dtype);

// Checks the backward arguments against the forward ones.
void check_rms_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                  const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                  const std::optional<at::Tensor>& weight, int64_t form);

using RmsNormOutputs = std::tuple<at::Tensor, at::Tensor>;  // (y, rstd) / (dx, dw)

// The ATen composite of each form: what the models compute, op for op (bit-identical to them on
// CPU). Runs on any device; the CPU kernel, and the CUDA one for the calls its kernels do not
// take (float64, uncommon dtype mixes). rstd has the input's leading (non-normalized) shape.
RmsNormOutputs rms_norm_fwd_composite(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight,
                                      std::optional<double> eps, int64_t form,
                                      std::optional<at::ScalarType> out_dtype);

RmsNormOutputs rms_norm_bwd_composite(const at::Tensor& grad_out, const at::Tensor& input,
                                      const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight, int64_t form,
                                      std::array<bool, 2> output_mask);

RmsNormOutputs rms_norm_fwd_cuda(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                 const std::optional<at::Tensor>& weight,
                                 std::optional<double> eps, int64_t form,
                                 std::optional<at::ScalarType> out_dtype);

RmsNormOutputs rms_norm_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                                 const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                 const std::optional<at::Tensor>& weight, int64_t form,
                                 std::array<bool, 2> output_mask);

// Residual add + RMSNorm (add_rms_norm.cpp): sum = residual + x in their dtype, y = the form's
// RMSNorm of sum; (y, sum, rstd). The backward gives x and residual the same gradient,
// dsum = the norm's input gradient + grad_sum (the sum's own users), rounded as native does.
using AddRmsNormOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

std::array<int64_t, 2> check_add_rms_norm_args(const at::Tensor& x, const at::Tensor& residual,
                                               at::IntArrayRef normalized_shape,
                                               const std::optional<at::Tensor>& weight,
                                               int64_t form);

void check_add_rms_norm_backward_args(const at::Tensor& grad_y,
                                      const std::optional<at::Tensor>& grad_sum,
                                      const at::Tensor& sum, const at::Tensor& rstd,
                                      at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight, int64_t form);

AddRmsNormOutputs add_rms_norm_fwd_composite(const at::Tensor& x, const at::Tensor& residual,
                                             at::IntArrayRef normalized_shape,
                                             const std::optional<at::Tensor>& weight,
                                             std::optional<double> eps, int64_t form);

// (grad_x, grad_residual, grad_weight); both input gradients are one tensor.
AddRmsNormOutputs add_rms_norm_bwd_composite(const at::Tensor& grad_y,
                                             const std::optional<at::Tensor>& grad_sum,
                                             const at::Tensor& sum, const at::Tensor& rstd,
                                             at::IntArrayRef normalized_shape,
                                             const std::optional<at::Tensor>& weight,
                                             int64_t form, std::array<bool, 3> output_mask);

// CUDA (dropout_add_layer_norm_cuda.cu: its residual-add row policies with RMS = true).
AddRmsNormOutputs add_rms_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& residual,
                                        at::IntArrayRef normalized_shape,
                                        const std::optional<at::Tensor>& weight,
                                        std::optional<double> eps, int64_t form);

AddRmsNormOutputs add_rms_norm_bwd_cuda(const at::Tensor& grad_y,
                                        const std::optional<at::Tensor>& grad_sum,
                                        const at::Tensor& sum, const at::Tensor& rstd,
                                        at::IntArrayRef normalized_shape,
                                        const std::optional<at::Tensor>& weight, int64_t form,
                                        std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor> add_rms_norm_eager(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      at::IntArrayRef normalized_shape,
                                                      const std::optional<at::Tensor>& weight,
                                                      std::optional<double> eps, int64_t form);

// fastlayers::rms_norm_fwd through the dispatcher (unboxed); returns y.
at::Tensor rms_norm_eager(const at::Tensor& input, at::IntArrayRef normalized_shape,
                          const std::optional<at::Tensor>& weight, std::optional<double> eps,
                          int64_t form);

}  // namespace fastlayers
