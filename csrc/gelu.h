// GELU and its derivative, both forms, in float (double for float64): shared by the CPU kernels,
// the CUDA elementwise kernels and the CUTLASS GEMM epilogue, so every path computes the same
// function.
//
//   erf  (approximate='none'): gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt 2))
//   tanh (approximate='tanh'): 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
//
// The formulas follow torch.nn.GELU's in opmath arithmetic (float; double for float64); erf and
// tanh are the accurate library functions, never the hardware approximations.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace fastlayers {

enum class GeluForm : int { kErf = 0, kTanh = 1 };

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
  const C inner = K::kSqrt2OverPi * (z + K::kCubic * z * z * z);
  return C(0.5) * z * (C(1) + gelu_detail::tanh_of(inner));
}

template <typename C>
C10_HOST_DEVICE inline C gelu_value(C z, GeluForm form) {
  return form == GeluForm::kTanh ? gelu_tanh(z) : gelu_erf(z);
}

// d gelu / dz.
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
  const C t = gelu_detail::tanh_of(K::kSqrt2OverPi * (z + K::kCubic * z2 * z));
  const C dinner = K::kSqrt2OverPi * (C(1) + C(3) * K::kCubic * z2);
  return C(0.5) * (C(1) + t) + C(0.5) * z * (C(1) - t * t) * dinner;
}

template <typename C>
C10_HOST_DEVICE inline C gelu_grad(C z, GeluForm form) {
  return form == GeluForm::kTanh ? gelu_tanh_grad(z) : gelu_erf_grad(z);
}

}  // namespace fastlayers
