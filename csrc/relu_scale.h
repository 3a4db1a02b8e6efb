// ReLUScale op family: relu(x) * alpha. Declarations shared by the CPU (.cpp) and CUDA (.cu) code.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

namespace fastlayers {

// The elementwise rules, shared by the CPU and CUDA kernels (float math).
// Forward: relu(v) * alpha, NaN propagating as torch.relu does.
C10_HOST_DEVICE inline float relu_scale_value(float v, float alpha) {
  return (v > 0.f || v != v) ? v * alpha : 0.f;
}

// Backward from the forward's result r = relu(x) * alpha alone: x > 0 exactly where r has
// alpha's sign (a NaN r passes the gradient, as torch.relu's backward does). alpha = 0 has a
// zero gradient.
C10_HOST_DEVICE inline float relu_scale_grad(float dy, float r, float alpha) {
  const bool pass = alpha > 0.f ? !(r <= 0.f) : (alpha < 0.f ? !(r >= 0.f) : false);
  return pass ? dy * alpha : 0.f;
}

void check_relu_scale_input(const at::Tensor& t, const char* arg);
void check_relu_scale_backward_args(const at::Tensor& grad_out, const at::Tensor& result);

at::Tensor relu_scale_cuda(const at::Tensor& input, double alpha);
void relu_scale_inplace_cuda(const at::Tensor& input, double alpha);
at::Tensor relu_scale_backward_cuda(const at::Tensor& grad_out, const at::Tensor& result,
                                    double alpha);

}  // namespace fastlayers
