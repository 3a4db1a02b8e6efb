// LayerNorm op family: declarations shared by the CPU (.cpp) and CUDA (.cu) kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "common/find_op.h"

namespace fastlayers {

// input viewed as [rows, cols], cols = prod(normalized_shape).
struct RowsCols {
  int64_t rows;
  int64_t cols;
};

// Validates the forward arguments (naming the bad one) and returns the row view.
RowsCols check_layer_norm_args(const at::Tensor& input, at::IntArrayRef normalized_shape,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias,
                               std::optional<at::ScalarType> out_dtype);

// Validates the backward arguments against the forward ones.
RowsCols check_layer_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                        const at::Tensor& mean, const at::Tensor& rstd,
                                        at::IntArrayRef normalized_shape,
                                        const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias);

using LayerNormOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The dtype of mean and rstd: the accumulation type, float64 for float64 inputs, else float32.
inline at::ScalarType layer_norm_stat_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

// Uninitialised (y, mean, rstd): y like input in out_dtype (default: input's dtype), mean and
// rstd in layer_norm_stat_dtype over the input's leading (non-normalized) dimensions.
LayerNormOutputs empty_forward_outputs(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                       std::optional<at::ScalarType> out_dtype);

// The ops' signatures, and their dispatcher handles (layer_norm.cpp; dropout_add_layer_norm
// calls them too).
using LayerNormFwdSig = LayerNormOutputs(const at::Tensor&, at::IntArrayRef,
                                         const std::optional<at::Tensor>&,
                                         const std::optional<at::Tensor>&, double,
                                         std::optional<at::ScalarType>);
using LayerNormBwdSig = LayerNormOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, at::IntArrayRef,
                                         const std::optional<at::Tensor>&,
                                         const std::optional<at::Tensor>&, std::array<bool, 3>);
const c10::TypedOperatorHandle<LayerNormFwdSig>& layer_norm_fwd_op();
const c10::TypedOperatorHandle<LayerNormBwdSig>& layer_norm_bwd_op();

// Calls fastlayers::layer_norm_fwd through the dispatcher (unboxed) and returns y.
at::Tensor layer_norm_eager(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps);

LayerNormOutputs layer_norm_fwd_cuda(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias, double eps,
                                     std::optional<at::ScalarType> out_dtype);

LayerNormOutputs layer_norm_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                                     const at::Tensor& mean, const at::Tensor& rstd,
                                     at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias,
                                     std::array<bool, 3> output_mask);

// float64 on CUDA (layer_norm_cuda_f64.cu), called by the two above once the arguments are
// checked, made contiguous and the outputs allocated (rows > 0). Absent parameters and outputs
// not wanted are undefined tensors.
void layer_norm_fwd_cuda_f64(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                             double eps, const at::Tensor& y, const at::Tensor& mean,
                             const at::Tensor& rstd, int64_t rows, int64_t cols);

void layer_norm_bwd_cuda_f64(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                             const at::Tensor& rstd, const at::Tensor& w, const at::Tensor& dx,
                             const at::Tensor& dw, const at::Tensor& db, int64_t rows,
                             int64_t cols);

}  // namespace fastlayers
