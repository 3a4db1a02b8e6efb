// The backward elementwise pass of the Linear + activation ops and the fixed-order column sums of
// the bias gradients (backward_pass.cu), shared by the ops' CUDA code (linear_act_cuda.cu).
#pragma once

#include <ATen/core/Tensor.h>

#include "common/activation.h"

namespace fastlayers {

// The backward elementwise pass's column sums: db ([n] in dy's dtype) already written when the
// pass ran one chunk of rows, else part ([chunks, n], float or float64) still to be finished.
struct DactSums {
  at::Tensor db;
  at::Tensor part;
};

// Runs the backward elementwise pass (dz from dy and saved, where dz is defined); with want_db,
// returns its column sums of dz, per chunk of rows (float, float64 for float64 inputs) unless one
// chunk covered every row; else an undefined db. dy, saved, dz [m, n] contiguous.
DactSums launch_dact_pass(const at::Tensor& dy, const at::Tensor& saved, const at::Tensor& dz,
                          bool want_db, Activation act);

// Runs the backward elementwise pass; returns the column sums of dz (the bias gradient, [n] in
// dy's dtype, finished in a fixed order) when want_db, else an undefined tensor.
at::Tensor launch_dact(const at::Tensor& dy, const at::Tensor& saved, const at::Tensor& dz,
                       bool want_db, Activation act);

// Column sums of t2 ([m, n] contiguous), [n] in its dtype, by the backward pass's reduction
// (deterministic).
at::Tensor column_sums(const at::Tensor& t2);

// The bias gradient from the fused backward GEMM's column partial sums (partials [rows, n] float;
// undefined: none), summed in a fixed order and rounded once to dtype; the pass sums in `also`,
// where still per chunk, are finished in the same launch (their db stays in also.db).
at::Tensor finish_bias_grads(const at::Tensor& partials, at::ScalarType dtype,
                             const DactSums& also = {});

}  // namespace fastlayers
