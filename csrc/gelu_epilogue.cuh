// GELU for the GEMM epilogue: both forms in sigmoid form, gelu(z) = z / (1 + 2^g(z)), with one
// hardware exp2 and one hardware reciprocal (MUFU) and a short polynomial, instead of erff or
// tanhf (~50 instructions each, which the epilogue cannot hide behind the next tile's mainloop).
//
//   tanh form: 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u)) exactly, so g(z) = -2 log2(e) u(z), with
//              u = sqrt(2/pi) (z + 0.044715 z^3): g = z (c0 + c1 z^2), no approximation.
//   erf form:  Phi(z) = 1 / (1 + 2^g(z)) with g(z) = -log2(Phi / (1 - Phi)), an odd function,
//              fitted as z Q(z^2), Q of degree 6 (least squares on |z| <= 5.5). Beyond 5.5 the
//              polynomial keeps Q <= -4.8 (checked up to |z| = 60; its leading coefficient is
//              negative), so 2^g goes to 0 (output z) or to inf (output -0) with no clamp: one
//              instruction per element fewer than clamping z^2, the same errors.
//
// Max abs error against float64 GELU, simulated in float32 with ex2/rcp at their documented
// accuracy over |z| <= 40: erf 5.9e-7 (torch's float erff GELU: 1.2e-6), tanh 5.2e-7. Far
// below a half/bfloat16 output's rounding, which is the only output this epilogue writes.
// NaN propagates; +inf -> +inf; -inf -> NaN (as torch's GELU).
//
// The derivatives (the backward GEMM's epilogue, dz = acc * gelu'(z)) reuse the same sigmoid
// forms: erf: Phi(z) + z phi(z), phi by one more exp2; tanh: with s = 0.5 (1 + tanh u) =
// 1 / (1 + e), e = 2^g, 1 - tanh^2 = 4 s (1 - s) and 1 - s = e s (no cancellation as s -> 1),
// so gelu' = s (1 + 2 z (e s) u'(z)). Max abs error against float64 over |z| <= 40, simulated
// as above: erf 2.1e-7 (the erff formula in float: 1.4e-7), tanh 2.6e-7 (torch's float tanh
// backward: 1.0e-6); outputs are half/bfloat16 (ulp >= 2^-11 relative).
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

// g(z) / z of the tanh form: -2 log2(e) sqrt(2/pi) (1 + 0.044715 z^2).
__device__ __forceinline__ float tanh_form_q(float z) {
  constexpr float kC0 = -2.302208198e+00f;  // -2 log2(e) sqrt(2/pi)
  constexpr float kC1 = -1.029432396e-01f;  // kC0 * 0.044715
  return fmaf(kC1, z * z, kC0);
}

__device__ __forceinline__ float gelu_tanh(float z) { return sigmoid_form(z, tanh_form_q(z)); }

// q = g(z) / z of the erf form, Phi(z) = 1 / (1 + 2^(z q)), from s = z^2 (inf for
// |z| > 1.8e19: q = -inf, and z q = -inf for z > 0, +inf for z < 0).
__device__ __forceinline__ float erf_form_q_of_square(float s) {
  float q = -5.269206759e-09f;
  q = fmaf(q, s, 3.876988025e-07f);
  q = fmaf(q, s, -1.149599804e-05f);
  q = fmaf(q, s, 1.597183189e-04f);
  q = fmaf(q, s, 9.442279125e-05f);
  q = fmaf(q, s, -1.048367986e-01f);
  return fmaf(q, s, -2.302208050e+00f);
}

__device__ __forceinline__ float gelu_erf(float z) {
  return sigmoid_form(z, erf_form_q_of_square(z * z));
}

__device__ __forceinline__ float gelu_tanh_grad(float z) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kCubic3 = 3.f * 0.044715f;
  // exponent capped at 126 so that e s stays finite (-> 1) for very negative z
  const float e = ex2_approx(fminf(z * tanh_form_q(z), 126.f));
  const float s = rcp_approx(1.f + e);
  const float du = kSqrt2OverPi * fmaf(kCubic3, z * z, 1.f);
  return s * fmaf(2.f * z * (e * s), du, 1.f);
}

__device__ __forceinline__ float gelu_erf_grad(float z) {
  // phi(z) = 2^(kHalfLog2e z^2 + kLog2InvSqrt2Pi): the constant factor folded into the exponent
  constexpr float kHalfLog2e = -0.7213475204444817f;       // -log2(e) / 2
  constexpr float kLog2InvSqrt2Pi = -1.3257480647361593f;  // log2(1 / sqrt(2 pi))
  const float s = z * z;  // shared by Phi's polynomial and phi's exponent
  const float cdf = rcp_approx(1.f + ex2_approx(z * erf_form_q_of_square(s)));
  return fmaf(z, ex2_approx(fmaf(kHalfLog2e, s, kLog2InvSqrt2Pi)), cdf);  // Phi + z phi
}

}  // namespace gelu_epilogue
}  // namespace fastlayers
