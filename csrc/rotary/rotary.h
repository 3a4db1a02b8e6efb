// Rotary position embedding op family: q and k rotated by (cos, sin) in one call, in the rounding
// sequence of the model's own apply_rotary_pos_emb (transformers' forms).
//
//   rotary_fwd(q, k, cos, sin, unsqueeze_dim, form) -> (q_out, k_out)
//   rotary_bwd(grad_q?, grad_k?, cos, sin, unsqueeze_dim, form, q_dtype) -> (dq, dk); a grad not
//       given gives an empty tensor.
//
// cos and sin have one shape and dtype, [B or 1, S, Dr] as transformers' rotary embeddings make
// them; cos.unsqueeze(unsqueeze_dim) broadcasts over q's and k's head dimension. q and k have one
// dtype; their heads may differ (GQA). The form's flags (kRotary*) say which of the models'
// sequences is computed; with x = q (or k), c = cos.unsqueeze(d), s = sin.unsqueeze(d):
//
//   xc   = kRotaryUpcast ? x.float() : x                   (Cohere; ModernBERT, per use)
//   r, p = kRotaryPartial ? (xc[..., :Dr], xc[..., Dr:]) : (xc, -)    (Phi-3, GPT-NeoX)
//   y    = (r * c) + (rotate(r) * s)                       (each op rounds to its result dtype)
//   y    = kRotaryPartial ? cat([y, p], -1) : y
//   out  = kRotaryCastBack ? y.to(x.dtype) : y             (OLMo2, Cohere, ModernBERT)
//
// rotate: cat(-r[..., h:], r[..., :h]) with h = Dr / 2 (transformers' rotate_half), or with
// kRotaryInterleaved stack([-r[..., 1::2], r[..., ::2]], -1).flatten(-2) (Cohere). Without
// kRotaryPartial, Dr must equal the head dim as the models' forms require.
//
// Rounding, per element (C = the dtype of r * c: result_type(xc, cos); X = the dtype the grads
// of r's uses are summed in: xc's, or x's with kRotaryUpcastEach, where the model upcasts x once
// per use (ModernBERT: q.float() * cos + rotate_half(q.float()) * sin), so each use's grad is
// cast back to x's dtype before the sum; the forwards are the same):
//   forward   y = rnd_C(rnd_C(r * c) + rnd_C(rot(r) * s)), then out's cast;
//   backward (what native autograd computes, step for step; g in out's dtype, widened to C
//   exactly where kRotaryCastBack): dr = rnd_X(rnd_X(rnd_C(g * c)) + rot^T(rnd_X(rnd_C(g * s))))
//   (a float64 x under kRotaryUpcastEach rounds each product to float32 first, as x.float() does),
//   the passed-through part rnd_X(g); dx = dxc.to(x.dtype).
// rot^T is rotate's transpose: cat(u[..., h:], -u[..., :h]) (interleaved: pairs (u[2j+1],
// -u[2j])). A half-precision product of two values of its dtype is exact in float32, so float32
// arithmetic rounded to C reproduces ATen's kernels (which compute in float32 and round) bit for
// bit; CUDA kernels must not contract the multiply and add (__fmul_rn / __fadd_rn).
//
// CPU: ATen's own ops in the models' order (bit-identical to native, forward and backward). CUDA:
// one kernel launch for q and k where its kernels take the call (rotary_cuda.cu says which), else
// the same ATen composite
// on the GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace fastlayers {

// The form's flags (the schema's `form`, an int; fastlayers/ops/rotary.py names them).
constexpr int64_t kRotaryInterleaved = 1;
constexpr int64_t kRotaryUpcast = 2;
constexpr int64_t kRotaryCastBack = 4;
constexpr int64_t kRotaryPartial = 8;
constexpr int64_t kRotaryUpcastEach = 16;  // with kRotaryUpcast: see "Rounding" above
constexpr int64_t kRotaryFlags = 31;

using RotaryPair = std::tuple<at::Tensor, at::Tensor>;

// Checks the arguments (naming them): q and k floating, one device and dtype, at least 1-D; cos
// and sin one shape, dtype and device with q; form within kRotaryFlags; unsqueeze_dim a valid
// dimension of cos.unsqueeze. Shapes that do not broadcast fail as the native ops fail.
void check_rotary_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form);

// The model's op sequence (rotary.h's header), ATen ops called above autograd where the caller is:
// what the op's autograd kernel runs for calls its node does not cover (q and k of two dtypes,
// cos / sin of two dtypes or shapes or requiring grad), as the model's function would.
RotaryPair rotary_native(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form);

// rotary_bwd's checks (naming the argument): the grads floating, on cos's device; q_dtype one of the
// four; check_rotary_args' checks of cos, sin, unsqueeze_dim and form (no tensor allocated).
void check_rotary_bwd_args(const std::optional<at::Tensor>& grad_q,
                           const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                           at::ScalarType q_dtype);

// The ATen composites (the CPU kernels, and CUDA's path where its kernel does not take a call).
RotaryPair rotary_fwd_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form);
RotaryPair rotary_bwd_composite(const std::optional<at::Tensor>& grad_q,
                                const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                                at::ScalarType q_dtype);

// An output of x's rotation: x's layout (empty_like) where the form has no pass-through part and
// the shape is x's, as the native ops lay it out; contiguous otherwise.
at::Tensor rotary_out_like(const at::Tensor& x, at::IntArrayRef shape, at::ScalarType dtype,
                           int64_t form);

// The output dtype of a call (what the composite returns): see the header comment.
at::ScalarType rotary_out_dtype(at::ScalarType q_dtype, at::ScalarType cos_dtype, int64_t form);

RotaryPair rotary_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form);
RotaryPair rotary_bwd_cuda(const std::optional<at::Tensor>& grad_q,
                           const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                           at::ScalarType q_dtype);

// rotary_fwd through the dispatcher (same autograd, same kernels): the _C.rotary fast path.
RotaryPair rotary_eager(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form);

}  // namespace fastlayers
