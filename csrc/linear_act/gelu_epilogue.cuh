// GELU and its derivative for the GEMM epilogues, from hardware exp2 (and, for the tanh form,
// reciprocal) operations (MUFU) and a few FFMAs, instead of erff or tanhf (~50 instructions each,
// which the epilogue cannot hide behind the next tile's mainloop). On an H100 the FFMA-pipe
// instructions cost the GEMM most (beside wgmma they slow the mainloop), MUFU operations less
// (an experiment script, since deleted; docs/decisions.md): each form below has the fewest float
// instructions found for its accuracy.
//
//   erf form:  gelu(z) = z Phi(z), Phi from its lower tail t = Phi(-|z|) = 2^P(-|z|) as 1 - t
//              for z >= 0 and t below (no cancellation: t <= 1/2). P(a) ~ log2 Phi(a) for a <= 0
//              is a degree-8 polynomial (weighted Lawson minimax on [-7, 0]: log-space error
//              <= 2e-5, tighter where Phi is large; its leading coefficient is negative and it
//              keeps falling below -7, checked to -1000, so 2^P goes to 0 in the far tail). One
//              exp2, no reciprocal (the sigmoid form it replaced, 1 / (1 + 2^(z Q(z^2))), took
//              both: the erf GEMM at 8192x768->3072 went from 1.23-1.31x to 1.17x of the
//              identity-epilogue GEMM). The negative tail keeps its relative accuracy (2e-5 for
//              -7 <= z <= -5, 2e-3 down to -8), where float erff GELU (native's) loses it to
//              cancellation (4% off at z = -5, 0 beyond -5.9).
//   tanh form: 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u)) exactly, so gelu(z) = z / (1 + 2^g(z)) with
//              g(z) = -2 log2(e) u(z), u = sqrt(2/pi) (z + 0.044715 z^3): g = z (c0 + c1 z^2), no
//              approximation but ex2 and rcp. (Replacing rcp by a quadratic and two Newton steps
//              on [1, 2] made the backward GEMM 7-14% slower, 93.6 against 82.4 us at BERT-base
//              and 130.2 against 121.9 at GPT-2 medium: nine FFMAs cost more than one MUFU.)
//
// Max abs error against float64, simulated in float32 with ex2/rcp at their documented accuracy
// over |z| <= 40: gelu erf 7.4e-7 (relative 1.3e-5 with |gelu| below 2^-14 counted as 2^-14;
// torch's float erff GELU: 1.2e-6 abs), tanh 5.2e-7. The derivatives (the backward GEMM's
// dz = acc * gelu'(z)): erf: Phi as above plus z phi(z), phi by a second exp2, 7.5e-7 (the erff
// formula in float: 1.4e-7); tanh: with s = 0.5 (1 + tanh u) = 1 / (1 + e), e = 2^g,
// 1 - tanh^2 = 4 s (1 - s) and 1 - s = e s (no cancellation as s -> 1), so
// gelu' = s (1 + 2 z (e s) u'(z)), 2.6e-7 (torch's float tanh backward: 1.0e-6). Far below a
// half/bfloat16 output's rounding (ulp >= 2^-11 relative), the only outputs these epilogues
// write. NaN propagates; gelu: +inf -> +inf, -inf -> NaN (as torch's GELU).
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

// g(z) / z of the tanh form: -2 log2(e) sqrt(2/pi) (1 + 0.044715 z^2).
__device__ __forceinline__ float tanh_form_q(float z) {
  constexpr float kC0 = -2.302208198e+00f;  // -2 log2(e) sqrt(2/pi)
  constexpr float kC1 = -1.029432396e-01f;  // kC0 * 0.044715
  return fmaf(kC1, z * z, kC0);
}

// z / (1 + 2^(z q)): 2^(z q) overflows to inf for very negative z, giving z * 0.
__device__ __forceinline__ float gelu_tanh(float z) {
  return z * rcp_approx(1.f + ex2_approx(z * tanh_form_q(z)));
}

// log2 Phi(a) for a <= 0 (-inf at -inf: the degree is even, the leading coefficient negative).
__device__ __forceinline__ float log2_cdf_of_nonpositive(float a) {
  float p = -6.059285391e-09f;
  p = fmaf(p, a, 1.482484101e-06f);
  p = fmaf(p, a, 5.588225230e-05f);
  p = fmaf(p, a, 8.888907686e-04f);
  p = fmaf(p, a, 8.354528848e-03f);
  p = fmaf(p, a, 5.367606941e-02f);
  p = fmaf(p, a, -4.587011948e-01f);
  p = fmaf(p, a, 1.151183168e+00f);
  return fmaf(p, a, -9.999981665e-01f);
}

// Phi(z), the standard normal CDF, from its lower tail t = Phi(-|z|) (one exp2): 1 - t for
// z >= 0, t below (no cancellation: t <= 1/2).
__device__ __forceinline__ float normal_cdf(float z) {
  const float t = ex2_approx(log2_cdf_of_nonpositive(-fabsf(z)));
  return z >= 0.f ? 1.f - t : t;
}

// +inf: inf * 1; -inf: -inf * 0 = NaN, as torch.
__device__ __forceinline__ float gelu_erf(float z) { return z * normal_cdf(z); }

__device__ __forceinline__ float gelu_tanh_grad(float z) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kCubic3 = 3.f * 0.044715f;
  // exponent capped at 126 so that e s stays finite (-> 1) for very negative z
  const float e = ex2_approx(fminf(z * tanh_form_q(z), 126.f));
  const float s = rcp_approx(1.f + e);
  const float du = kSqrt2OverPi * fmaf(kCubic3, z * z, 1.f);
  return s * fmaf(2.f * z * (e * s), du, 1.f);
}

// gelu'(z) = Phi(z) + z phi(z), given cdf = Phi(z).
__device__ __forceinline__ float gelu_erf_grad_of(float z, float cdf) {
  // phi(z) = 2^(kHalfLog2e z^2 + kLog2InvSqrt2Pi): the constant factor folded into the exponent
  constexpr float kHalfLog2e = -0.7213475204444817f;       // -log2(e) / 2
  constexpr float kLog2InvSqrt2Pi = -1.3257480647361593f;  // log2(1 / sqrt(2 pi))
  return fmaf(z, ex2_approx(fmaf(kHalfLog2e, z * z, kLog2InvSqrt2Pi)), cdf);
}

__device__ __forceinline__ float gelu_erf_grad(float z) {
  return gelu_erf_grad_of(z, normal_cdf(z));
}

// gelu(z) and gelu'(z) together (the MLP's forward keeps the derivative): Phi(z) once, so
// gelu_erf's value and gelu_erf_grad's, bit for bit, for one more exp2.
__device__ __forceinline__ void gelu_erf_and_grad(float z, float& y, float& grad) {
  const float cdf = normal_cdf(z);
  y = z * cdf;
  grad = gelu_erf_grad_of(z, cdf);
}

// The tanh form's value and derivative together, from one exp2 and one reciprocal: y is
// gelu_tanh's, bit for bit. With s = 1 / (1 + e): 1 - tanh^2 = 4 s (1 - s) and z (1 - s) = z - y,
// so gelu' = s (1 + (z - y) 2 u'(z)), 2 u' one FFMA in z^2: four float instructions past y
// (gelu_tanh_grad's form, e s for 1 - s, takes eight). Where z is large, z - y loses the low bits
// of z (s -> 1): max abs error 3.2e-6 against float64 (float32 simulation, |z| <= 12; the e s
// form 2.6e-7), still far below a half/bfloat16 ulp of the kept derivative.
__device__ __forceinline__ void gelu_tanh_and_grad(float z, float& y, float& grad) {
  constexpr float kTwoDu0 = 2.f * 0.7978845608028654f;  // 2 sqrt(2/pi)
  constexpr float kTwoDu2 = kTwoDu0 * 3.f * 0.044715f;  // its z^2 coefficient
  const float s = rcp_approx(1.f + ex2_approx(z * tanh_form_q(z)));
  y = z * s;
  grad = s * fmaf(z - y, fmaf(kTwoDu2, z * z, kTwoDu0), 1.f);
}

}  // namespace gelu_epilogue
}  // namespace fastlayers
