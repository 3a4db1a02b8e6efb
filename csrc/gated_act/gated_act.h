// Gated activation op family: y = act(gate) * up, the elementwise core of gated MLPs (LLaMA's
// SwiGLU, Gemma's GeGLU, T5 v1.1). Declarations shared by the CPU (.cpp) and CUDA (.cu) code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "common/activation.h"
#include "linear_act/linear_act.h"

namespace fastlayers {

// The elementwise rules of the CUDA kernels, in A = at::opmath_type<T> (float; double for
// float64), rounding where native rounds: native computes a = act(gate) as a tensor of dtype T,
// then a * up, so a is rounded to T before the product.
template <typename T, Activation kAct, typename A>
C10_HOST_DEVICE inline A gated_act_value(A g, A u) {
  const A a = static_cast<A>(static_cast<T>(activation_value(g, kAct)));
  return a * u;
}

// Backward from dy, gate and up: dup = dy * round_T(act(g)) (what native's product backward
// computes), dgate = dy * up * act'(g) in A, rounded once by the caller's store (native rounds
// dy * up to T first; for ReLU, where act' only selects, the two agree bit for bit). ReLU's
// derivative reads its output as torch.relu's backward does: a NaN gate passes the gradient.
template <typename T, Activation kAct, typename A>
C10_HOST_DEVICE inline void gated_act_grad(A dy, A g, A u, A& dgate, A& dup) {
  const A a = static_cast<A>(static_cast<T>(activation_value(g, kAct)));
  dup = dy * a;
  const A dz = dy * u;
  if constexpr (kAct == Activation::kReLU) {
    dgate = a <= A(0) ? A(0) : dz;
  } else if constexpr (kAct == Activation::kSiLU) {
    dgate = dz * silu_grad(g);
  } else if constexpr (kAct == Activation::kGeluTanh) {
    dgate = dz * gelu_tanh_grad(g);
  } else {
    dgate = dz * gelu_erf_grad(g);
  }
}

// The schema's activation name -> the enum: 'silu', 'gelu' (erf), 'gelu_tanh' or 'relu'; any
// other name raises a ValueError naming `activation`.
Activation parse_gated_activation(c10::string_view activation);

// Checks gate and up (dtype, device, shape), naming the argument; grad_out too when defined.
void check_gated_act_args(const at::Tensor& gate, const at::Tensor& up,
                          const at::Tensor& grad_out = at::Tensor());

// gated_act_bwd's outputs: (grad_gate, grad_up, product), product being act(gate) * up again,
// bit for bit the forward's, for a backward that did not keep it (gated_act_down's); an output
// not asked for is an empty tensor.
using GatedActGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

at::Tensor gated_act_fwd_cuda(const at::Tensor& gate, const at::Tensor& up,
                              c10::string_view activation);
GatedActGrads gated_act_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& gate,
                                 const at::Tensor& up, c10::string_view activation,
                                 std::array<bool, 3> output_mask);

// gated_act_linear(gate, input, weight, activation) = act(gate) * (input . weight^T), inference
// only (no autograd): a gated MLP's up projection with the product. weight [n, k] in input's
// dtype, gate shaped input[..., :-1] + [n], all on one device; checked naming the argument.
// Returns the GEMM's dimensions.
LinearDims check_gated_act_linear_args(const at::Tensor& gate, const at::Tensor& input,
                                       const at::Tensor& weight);

// CUDA: the product in the up projection's GEMM epilogue (sm_90a CUTLASS) where the GEMM's
// rules take the call, else cuBLAS's GEMM and gated_act_fwd (linear_act_cuda.cu).
at::Tensor gated_act_linear_cuda(const at::Tensor& gate, const at::Tensor& input,
                                 const at::Tensor& weight, c10::string_view activation);

// Which CUDA path gated_act_linear takes for these arguments: 'cutlass_sm90' or
// 'fallback: <why>'.
std::string gated_act_linear_cuda_path(const at::Tensor& gate, const at::Tensor& input,
                                       const at::Tensor& weight, c10::string_view activation);

// gated_act_linear through the dispatcher: the _C.gated_act_linear fast path.
at::Tensor gated_act_linear_eager(const at::Tensor& gate, const at::Tensor& input,
                                  const at::Tensor& weight, const std::string& activation);

// gated_act_fwd through the dispatcher (same autograd, same kernels): the _C.gated_act fast path.
at::Tensor gated_act_eager(const at::Tensor& gate, const at::Tensor& up,
                           const std::string& activation);

// gated_act_down through the dispatcher: the _C.gated_act_down fast path.
at::Tensor gated_act_down_eager(const at::Tensor& gate, const at::Tensor& up,
                                const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const std::string& activation);

}  // namespace fastlayers
