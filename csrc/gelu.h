// GELU and its derivative, both forms, in float: shared by the CPU kernels, the CUDA
// elementwise kernels and the CUTLASS GEMM epilogue, so every path computes the same function.
//
//   erf  (approximate='none'): gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt 2))
//   tanh (approximate='tanh'): 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
//
// The formulas follow torch.nn.GELU's in float (opmath) arithmetic; erff and tanhf are the
// accurate library functions, never the hardware approximations.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace fastlayers {

enum class GeluForm : int { kErf = 0, kTanh = 1 };

namespace gelu_detail {
constexpr float kSqrtHalf = 0.70710678118654752440f;        // 1 / sqrt(2)
constexpr float kSqrt2OverPi = 0.79788456080286535588f;     // sqrt(2 / pi)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;      // 1 / sqrt(2 pi)
constexpr float kCubic = 0.044715f;
}  // namespace gelu_detail

C10_HOST_DEVICE inline float gelu_erf(float z) {
  return z * 0.5f * (1.f + erff(z * gelu_detail::kSqrtHalf));
}

C10_HOST_DEVICE inline float gelu_tanh(float z) {
  using namespace gelu_detail;
  const float inner = kSqrt2OverPi * (z + kCubic * z * z * z);
  return 0.5f * z * (1.f + tanhf(inner));
}

C10_HOST_DEVICE inline float gelu_value(float z, GeluForm form) {
  return form == GeluForm::kTanh ? gelu_tanh(z) : gelu_erf(z);
}

// d gelu / dz.
C10_HOST_DEVICE inline float gelu_erf_grad(float z) {
  using namespace gelu_detail;
  const float cdf = 0.5f * (1.f + erff(z * kSqrtHalf));
  const float pdf = kInvSqrt2Pi * expf(-0.5f * z * z);
  return cdf + z * pdf;
}

C10_HOST_DEVICE inline float gelu_tanh_grad(float z) {
  using namespace gelu_detail;
  const float z2 = z * z;
  const float t = tanhf(kSqrt2OverPi * (z + kCubic * z2 * z));
  const float dinner = kSqrt2OverPi * (1.f + 3.f * kCubic * z2);
  return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * dinner;
}

C10_HOST_DEVICE inline float gelu_grad(float z, GeluForm form) {
  return form == GeluForm::kTanh ? gelu_tanh_grad(z) : gelu_erf_grad(z);
}

}  // namespace fastlayers
