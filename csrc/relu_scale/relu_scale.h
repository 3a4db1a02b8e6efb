// ReLUScale op family: relu(x) * alpha. Declarations shared by the CPU (.cpp) and CUDA (.cu) code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include "common/activation.h"

namespace fastlayers {

// The elementwise rules, shared by the CPU and CUDA kernels, in C = float (float32 and half
// inputs) or double (float64 inputs; alpha then is not rounded to float).
// Forward: relu(v) * alpha exactly as torch.relu(x) * alpha computes it, bit for bit: relu as
// ATen's clamp_min(v, 0) (relu_value in activation.h, which the fused Linear + ReLU uses too),
// then the product, so that zeros carry the sign native's
// carry (0 * -0.7 is -0.0) and 0 * inf is NaN, as native's is when alpha overflows float32.
template <typename C>
C10_HOST_DEVICE inline C relu_scale_value(C v, C alpha) {
  return relu_value(v) * alpha;
}

// Backward from the forward's result r = relu(x) * alpha alone: x > 0 exactly where r has
// alpha's sign (a NaN r passes the gradient, as torch.relu's backward does; a zero r of either
// sign does not). alpha = 0 has a zero gradient. Needs alpha finite in C: with an infinite
// or NaN alpha, r is NaN for x <= 0 too (0 * inf), and autograd saves relu(x) instead (see
// relu_scale.cpp).
template <typename C>
C10_HOST_DEVICE inline C relu_scale_grad(C dy, C r, C alpha) {
  const bool pass = alpha > C(0) ? !(r <= C(0)) : (alpha < C(0) ? !(r >= C(0)) : false);
  return pass ? dy * alpha : C(0);
}

void check_relu_scale_input(const at::Tensor& t, const char* arg);
void check_relu_scale_backward_args(const at::Tensor& grad_out, const at::Tensor& result);

at::Tensor relu_scale_cuda(const at::Tensor& input, double alpha);

// relu_scale through the dispatcher (same autograd, same kernels): the _C.relu_scale fast path.
at::Tensor relu_scale_eager(const at::Tensor& input, double alpha);
void relu_scale_inplace_cuda(const at::Tensor& input, double alpha);
at::Tensor relu_scale_backward_cuda(const at::Tensor& grad_out, const at::Tensor& result,
                                    double alpha);

}  // namespace fastlayers
