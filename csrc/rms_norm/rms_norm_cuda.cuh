// What the RMSNorm CUDA entry points (rms_norm_cuda.cu, and add + RMSNorm's in
// dropout_add_layer_norm_cuda.cu, where the residual-add row policies live) share: which calls
// the row kernels take, the weight as they read it, and the form as an ln::RmsForm.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "layer_norm/layer_norm_kernels.cuh"
#include "rms_norm/rms_norm.h"

namespace fastlayers {
namespace rms {

inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The weight as the kernels read it: contiguous, in the input's dtype or float32 (other half
// dtypes converted: exact).
inline std::optional<at::Tensor> kernel_weight(const std::optional<at::Tensor>& weight,
                                               at::ScalarType input) {
  if (!has(weight)) return std::nullopt;
  const at::ScalarType st = weight->scalar_type();
  return st == input || st == at::kFloat ? weight->contiguous() : weight->to(at::kFloat);
}

inline ln::RmsForm kernel_form(RmsNormForm form, at::ScalarType input,
                               const std::optional<at::Tensor>& weight) {
  ln::RmsForm rf;
  rf.offset = form == RmsNormForm::kGemma ? 1.f : 0.f;
  const auto mid = rms_norm_mid_dtype(form, input, weight);
  rf.mid = !mid.has_value() ? 0 : (*mid == at::kHalf ? 1 : 2);
  return rf;
}

// Whether the row kernels take a call: float32/float16/bfloat16 input, y (and in the backward
// its gradient) in the input's dtype, no float64 weight. The rest runs the composite on the GPU:
// a float32 y from a half input (a float32 weight in LLaMA's form, nn.RMSNorm under autocast)
// would double the kernels' instantiations, which the 2-core build cannot afford.
inline bool kernels_take(at::ScalarType input, const std::optional<at::Tensor>& weight,
                         at::ScalarType out) {
  return input != at::kDouble && out == input &&
         !(has(weight) && weight->scalar_type() == at::kDouble);
}

}  // namespace rms
}  // namespace fastlayers
