// The activations of the fused Linear + activation and gated-activation op families, and their
// derivatives, in float (double for float64): shared by the CPU kernels, the CUDA elementwise
// kernels and the CUTLASS GEMM epilogue, so every path computes the same function. One enum
// names the activation from the op schema's string to the epilogue.
//
//   kGeluErf  ('gelu'):      gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt 2))
//   kGeluTanh ('gelu_tanh'): 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
//   kReLU     ('relu'):      max(z, 0) as ATen's clamp_min: NaN propagates (ReLUScale's rule)
//   kIdentity:               z; only the benchmarks' raw GEMM entry uses it (never in a schema)
//   kSavedDerivative:        backward only: what was saved is act'(z) itself (an MLP's forward
//                            kept it, linear_act_linear.cpp), so dL/dz = dL/dy * saved
//   kSiLU     ('silu'):      z / (1 + exp(-z)), torch's silu formula; the gated MLPs' activation
//                            (gated_act only: linear_act's parser and range checks refuse 5)
//
// The GELU and SiLU formulas follow torch's in opmath arithmetic (float; double for float64);
// erf, tanh and exp are the accurate library functions, never the hardware approximations.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace fastlayers {

enum class Activation : int {
  kGeluErf = 0,
  kGeluTanh = 1,
  kReLU = 2,
  kIdentity = 3,
  kSavedDerivative = 4,
  kSiLU = 5
};

// Backward needs the pre-activation z for GELU; for ReLU the output y tells where z > 0 (y > 0
// exactly there, and a NaN y passes the gradient as torch.relu's backward does), so autograd
// saves y, which exists anyway, and no pre-activation is stored.
C10_HOST_DEVICE constexpr bool grad_from_output(Activation a) { return a == Activation::kReLU; }

// The functions are templates over the arithmetic type C: float (float32 and half inputs) or
// double (float64 inputs), with the same formulas.
namespace gelu_detail {
template <typename C>
struct K {
  static constexpr C kSqrtHalf = C(0.70710678118654752440);     // 1 / sqrt(2)
  static constexpr C kSqrt2OverPi = C(0.79788456080286535588);  // sqrt(2 / pi)
  static constexpr C kInvSqrt2Pi = C(0.39894228040143267794);   // 1 / sqrt(2 pi)
  static constexpr C kCubic = C(0.044715);
};
C10_HOST_DEVICE inline float erf_of(float v) { return erff(v); }
C10_HOST_DEVICE inline double erf_of(double v) { return erf(v); }
C10_HOST_DEVICE inline float tanh_of(float v) { return tanhf(v); }
C10_HOST_DEVICE inline double tanh_of(double v) { return tanh(v); }
C10_HOST_DEVICE inline float exp_of(float v) { return expf(v); }
C10_HOST_DEVICE inline double exp_of(double v) { return exp(v); }
}  // namespace gelu_detail

template <typename C>
C10_HOST_DEVICE inline C gelu_erf(C z) {
  using K = gelu_detail::K<C>;
  return z * C(0.5) * (C(1) + gelu_detail::erf_of(z * K::kSqrtHalf));
}

template <typename C>
C10_HOST_DEVICE inline C gelu_tanh(C z) {
  using K = gelu_detail::K<C>;
  // kappa * (z * z * z), grouped as torch's kernels group it (the same rounding)
  const C inner = K::kSqrt2OverPi * (z + K::kCubic * (z * z * z));
  return C(0.5) * z * (C(1) + gelu_detail::tanh_of(inner));
}

// relu as ATen's clamp_min(v, 0): NaN propagates; a -0.0 input stays -0.0 on CPU (std::max) and
// is whatever fmax makes of it on CUDA, as ATen's own kernels.
template <typename C>
C10_HOST_DEVICE inline C relu_value(C v) {
#ifdef __CUDA_ARCH__
  return v != v ? v : ::fmax(v, C(0));
#else
  return v < C(0) ? C(0) : v;
#endif
}

// silu as torch's CUDA kernel writes it (x / (1 + exp(-x)) in opmath): a division, not
// x * sigmoid(x), so the rounding matches.
template <typename C>
C10_HOST_DEVICE inline C silu_value(C z) {
  return z / (C(1) + gelu_detail::exp_of(-z));
}

template <typename C>
C10_HOST_DEVICE inline C activation_value(C z, Activation a) {
  switch (a) {
    case Activation::kGeluErf:
      return gelu_erf(z);
    case Activation::kGeluTanh:
      return gelu_tanh(z);
    case Activation::kReLU:
      return relu_value(z);
    case Activation::kSiLU:
      return silu_value(z);
    default:
      return z;
  }
}

// d gelu / dz at the pre-activation z.
template <typename C>
C10_HOST_DEVICE inline C gelu_erf_grad(C z) {
  using K = gelu_detail::K<C>;
  const C cdf = C(0.5) * (C(1) + gelu_detail::erf_of(z * K::kSqrtHalf));
  const C pdf = K::kInvSqrt2Pi * gelu_detail::exp_of(C(-0.5) * z * z);
  return cdf + z * pdf;
}

template <typename C>
C10_HOST_DEVICE inline C gelu_tanh_grad(C z) {
  using K = gelu_detail::K<C>;
  const C z2 = z * z;
  const C t = gelu_detail::tanh_of(K::kSqrt2OverPi * (z + K::kCubic * (z2 * z)));
  const C dinner = K::kSqrt2OverPi * (C(1) + C(3) * K::kCubic * z2);
  return C(0.5) * (C(1) + t) + C(0.5) * z * (C(1) - t * t) * dinner;
}

// d silu / dz = s (1 + z (1 - s)), s = sigmoid(z), as torch's silu_backward.
template <typename C>
C10_HOST_DEVICE inline C silu_grad(C z) {
  const C s = C(1) / (C(1) + gelu_detail::exp_of(-z));
  return s * (C(1) + z * (C(1) - s));
}

// dL/dz from dL/dy and what backward keeps: z for GELU, y = relu(z) for ReLU
// (grad_from_output), act'(z) for kSavedDerivative. torch.relu's backward (threshold_backward)
// passes dy where !(y <= 0). Not kSiLU: gated_act's kernels call silu_grad themselves, so the
// GEMM epilogues and the backward pass that call this (never with kSiLU) compile as before.
template <typename C>
C10_HOST_DEVICE inline C activation_grad(C dy, C saved, Activation a) {
  switch (a) {
    case Activation::kGeluErf:
      return dy * gelu_erf_grad(saved);
    case Activation::kGeluTanh:
      return dy * gelu_tanh_grad(saved);
    case Activation::kReLU:
      return saved <= C(0) ? C(0) : dy;
    case Activation::kSavedDerivative:
      return dy * saved;
    default:
      return dy;
  }
}

}  // namespace fastlayers
