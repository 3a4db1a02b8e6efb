// Fused Linear + activation op family (GELU erf/tanh, ReLU): declarations shared by the CPU (.cpp)
// and CUDA (.cu) code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "common/activation.h"

namespace fastlayers {

// input viewed as [m, k]; the output is [m, n].
struct LinearDims {
  int64_t m;
  int64_t k;
  int64_t n;
};

// What every call of a fused CUTLASS GEMM (sm90 or sm80) needs, in words; the CUDA path checks it
// (fused_gemm_unfit in linear_act_cuda.cu).
constexpr const char* kFusedGemmInputs =
    "float16/bfloat16 inputs, in_features and out_features positive multiples of 8, 16-byte "
    "aligned input, weight and bias";

// The schema's activation string: 'gelu' (erf), 'gelu_tanh' or 'relu'; anything else is an
// error naming the argument.
Activation parse_activation(c10::string_view activation);

// Validates the forward arguments (naming the bad one) and returns the GEMM dimensions.
// weight is [n, k], or [k, n] when weight_transposed (HuggingFace Conv1D's layout).
LinearDims check_linear_act_args(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, bool weight_transposed);

// The output shape: input's leading dimensions, then n.
std::vector<int64_t> linear_act_out_shape(const at::Tensor& input, int64_t n);

// (y, preact): preact is z = input . W^T + bias in the input dtype when save_preact, act'(z)
// when save_derivative (GELU), else an empty tensor.
using LinearActOutputs = std::tuple<at::Tensor, at::Tensor>;

// Checks linear_act_fwd's save_preact and save_derivative (not both; the derivative for GELU).
void check_save_args(Activation act, bool save_preact, bool save_derivative);

// act'(z) in z's dtype (GELU, by ATen's gelu_backward on any device): what linear_act_fwd keeps
// with save_derivative where no fused epilogue computes it beside act(z).
at::Tensor activation_derivative(const at::Tensor& z, Activation act);

// linear_act_dgrad's derivative form: kSavedDerivative when saved holds act'(z), else the
// activation parsed.
Activation dgrad_form(c10::string_view activation, bool saved_is_derivative);

// Whether an MLP's forward should keep act'(z) rather than z for its backward: where the sm90
// forward kernel computes it in its epilogue beside act(z) (GELU, half or bfloat16, an sm_90 GPU,
// sizes its rule takes), so the backward GEMM's epilogue only multiplies. From devices, dtypes and
// sizes alone (no data pointers: fake tensors too); defined in CUDA builds.
bool linear_act_keeps_derivative(const at::Tensor& input, const at::Tensor& weight,
                                 bool has_bias, Activation act, bool weight_transposed);
// (grad_input, grad_weight, grad_bias); an output not asked for is an empty tensor.
using LinearActGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Validates the backward arguments against the forward ones. saved is what backward reads the
// activation's derivative from: the pre-activation z, or the output y where
// grad_from_output(activation) (ReLU).
LinearDims check_linear_act_backward_args(const at::Tensor& grad_out, const at::Tensor& saved,
                                          const at::Tensor& input, const at::Tensor& weight,
                                          bool weight_transposed);

// The rest of backward once the elementwise pass has run, shared by the CPU and CUDA kernels:
// dx and dw by GEMMs from dz = dL/dz ([m, n]; undefined when neither is wanted; ATen GEMMs, cuBLAS
// on CUDA), returned with db, the bias gradient the pass summed ([n] in the input's dtype;
// undefined when not wanted).
LinearActGrads linear_act_grads_from_dz(const at::Tensor& dz, const at::Tensor& db,
                                        const at::Tensor& input, const at::Tensor& weight,
                                        const LinearDims& d, bool weight_transposed, bool want_dx,
                                        bool want_dw);

// The product of t's leading dimensions: the rows of its [rows, last dimension] view.
int64_t rows_of(const at::Tensor& t);

// column_sums(grad): grad summed over every dimension but the last, [n] in its dtype (a Linear's
// bias gradient). CPU: ATen's sum, as nn.Linear's backward; CUDA: the backward pass's column
// reduction (fixed order: deterministic), which read 12.6 MB of bf16 3-4x faster than ATen's
// sum (20.8 us for 8192 x 768 on an H100).
void check_column_sums_args(const at::Tensor& grad);
at::Tensor column_sums_cuda(const at::Tensor& grad);

// (dz, db) of linear_act_dgrad: the gradient at the activation's input of an MLP
// Linear -> act -> Linear2 from the gradient at Linear2's output: dz = act'(saved) *
// (grad_out . W2) with W2 = weight [n2, n1], or weight stored [n1, n2] when weight_transposed;
// saved is what the activation's derivative is read from (z, or the output for ReLU), or, when
// saved_is_derivative, act'(z) itself (dz = saved * (grad_out . W2)); shaped [..., n1]; dz is
// shaped like saved; db = column sums of dz ([n1]) when want_db, else empty; grad_out_sums =
// column sums of grad_out ([n2], the next Linear's bias gradient) when want_grad_out_sums, else
// empty (on CUDA their reduction shares a launch with db's).
using DgradOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Validates linear_act_dgrad's arguments (naming the bad one); returns {m, k = n2, n = n1}.
LinearDims check_linear_act_dgrad_args(const at::Tensor& grad_out, const at::Tensor& weight,
                                       const at::Tensor& saved, bool weight_transposed);

DgradOutputs linear_act_dgrad_cuda(const at::Tensor& grad_out, const at::Tensor& weight,
                                   const at::Tensor& saved, c10::string_view activation,
                                   bool weight_transposed, bool want_db, bool saved_is_derivative,
                                   bool want_grad_out_sums);

// Which CUDA path linear_act_dgrad takes for these arguments: "cutlass_sm90" (one GEMM with the
// derivative in its epilogue, which also sums db's per-tile partials) or "fallback: <why>"
// (cuBLAS, then the elementwise backward pass, which also sums db).
std::string linear_act_dgrad_cuda_path(const at::Tensor& grad_out, const at::Tensor& weight,
                                       const at::Tensor& saved, c10::string_view activation,
                                       bool weight_transposed);

// Calls fastlayers::linear_act_linear through the dispatcher (unboxed) and returns y.
at::Tensor linear_act_linear_eager(const at::Tensor& input, const at::Tensor& weight1,
                                   const std::optional<at::Tensor>& bias1,
                                   const at::Tensor& weight2,
                                   const std::optional<at::Tensor>& bias2,
                                   c10::string_view activation, bool weight1_transposed,
                                   bool weight2_transposed);

// Calls fastlayers::linear_act_fwd through the dispatcher (unboxed) and returns y.
at::Tensor linear_act_eager(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, c10::string_view activation,
                            bool weight_transposed);

LinearActOutputs linear_act_fwd_cuda(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     c10::string_view activation, bool weight_transposed,
                                     bool save_preact, bool save_derivative);

LinearActGrads linear_act_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& saved,
                                   const at::Tensor& input, const at::Tensor& weight,
                                   bool has_bias, c10::string_view activation,
                                   bool weight_transposed, std::array<bool, 3> output_mask);

// Which CUDA path a forward with these arguments takes: "cutlass_sm90", "cutlass_sm80" (8.x
// GPUs), or "fallback: <why>"
// (GELU: a cuBLAS GEMM, then a separate GELU pass; ReLU: cuBLASLt's bias + ReLU epilogue).
std::string linear_act_cuda_path(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, c10::string_view activation,
                                 bool weight_transposed);

// Benchmark/tuning entry: runs the sm90 kernel with a given tile config (-1: auto) and epilogue
// (an Activation value: 0 erf, 1 tanh, 2 relu, 3 identity) on 2-D contiguous tensors, bypassing
// the path choice.
void linear_act_sm90_raw(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const at::Tensor& y,
                         const std::optional<at::Tensor>& preact, bool weight_transposed,
                         int64_t epilogue, int64_t config);

// The same for the sm80 kernel (CUTLASS 2.x, mma.sync), on any GPU from compute capability 8.0
// on (an H100 included: how it is tested and timed there), any size; config an sm80::Config.
void linear_act_sm80_raw(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const at::Tensor& y,
                         const std::optional<at::Tensor>& preact, bool weight_transposed,
                         int64_t epilogue, int64_t config);

// Benchmark/tuning entry of the sm90 backward GEMM: dz = activation_grad(grad_out . W2, saved)
// with a given tile config (-1: auto) and epilogue (Activation value; 3 = identity: dz = the
// GEMM, the saved tensor still read), on 2-D contiguous tensors, bypassing the path choice.
// Returns the bias gradient (dz's column sums from the epilogue, as linear_act_dgrad computes
// it) when want_db, else an empty tensor.
at::Tensor linear_act_dgrad_sm90_raw(const at::Tensor& grad_out, const at::Tensor& weight,
                                     const at::Tensor& saved, const at::Tensor& dz,
                                     bool weight_transposed, int64_t epilogue, int64_t config,
                                     bool want_db);

// Benchmark/tuning entry of the backward GEMM's fallback (cuBLAS, then the elementwise backward
// pass that writes dz and sums db): (dz, db), db empty unless want_db; epilogue an Activation
// value other than identity. Bypasses the path choice, so the size rule can be checked against
// it.
std::tuple<at::Tensor, at::Tensor> linear_act_dgrad_fallback_raw(
    const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& saved,
    bool weight_transposed, int64_t epilogue, bool want_db);

}  // namespace fastlayers
