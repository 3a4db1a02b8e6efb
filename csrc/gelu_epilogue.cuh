// GELU for the GEMM epilogue: both forms in sigmoid form, gelu(z) = z / (1 + 2^g(z)), with one
// hardware exp2 and one hardware reciprocal (MUFU) and a short polynomial, instead of erff or
// tanhf (~50 instructions each, which the epilogue cannot hide behind the next tile's mainloop).
//
//   tanh form: 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u)) exactly, so g(z) = -2 log2(e) u(z), with
//              u = sqrt(2/pi) (z + 0.044715 z^3): g = z (c0 + c1 z^2), no approximation.
//   erf form:  Phi(z) = 1 / (1 + 2^g(z)) with g(z) = -log2(Phi / (1 - Phi)), an odd function,
//              fitted as z Q(z^2), Q of degree 6 (least squares on |z| <= 5.5). Beyond 5.5,
//              z^2 is clamped so g stays linear in z: there Phi < 2e-8 on the negative side
//              and the output decays to zero geometrically.
//
// Max abs error against float64 GELU, simulated in float32 with ex2/rcp at their documented
// accuracy over |z| <= 40: erf 5.9e-7 (torch's float erff GELU: 1.2e-6), tanh 5.2e-7. Far
// below a half/bfloat16 output's rounding, which is the only output this epilogue writes.
// NaN propagates; +inf -> +inf; -inf -> NaN (as torch's GELU).
#pragma once

#include <cuda_runtime.h>

namespace fastlayers {
namespace gelu_epilogue {

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// z * 1 / (1 + 2^(z q)): 2^(z q) overflows to inf for very negative z, giving z * 0.
__device__ __forceinline__ float sigmoid_form(float z, float q) {
  return z * rcp_approx(1.f + ex2_approx(z * q));
}

__device__ __forceinline__ float gelu_tanh(float z) {
  constexpr float kC0 = -2.302208198e+00f;  // -2 log2(e) sqrt(2/pi)
  constexpr float kC1 = -1.029432396e-01f;  // kC0 * 0.044715
  return sigmoid_form(z, fmaf(kC1, z * z, kC0));
}

__device__ __forceinline__ float gelu_erf(float z) {
  const float s = fminf(z * z, 30.25f);  // 5.5^2 (a NaN z makes s 30.25, but z q stays NaN)
  float q = -5.269206759e-09f;
  q = fmaf(q, s, 3.876988025e-07f);
  q = fmaf(q, s, -1.149599804e-05f);
  q = fmaf(q, s, 1.597183189e-04f);
  q = fmaf(q, s, 9.442279125e-05f);
  q = fmaf(q, s, -1.048367986e-01f);
  q = fmaf(q, s, -2.302208050e+00f);
  return sigmoid_form(z, q);
}

}  // namespace gelu_epilogue
}  // namespace fastlayers
