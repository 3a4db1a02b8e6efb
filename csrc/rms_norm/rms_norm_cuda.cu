// RMSNorm CUDA entry points: LayerNorm's row kernels (layer_norm/layer_norm_kernels.cuh) with
// RMS = true and the form's RmsForm (rounding before the weight, Gemma's offset). Calls those
// kernels do not take (float64, a float64 weight, an output dtype that is neither the input's
// nor float32) run the composite of rms_norm.cpp on the GPU.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

#include "common/arch_check.h"
#include "common/common.h"
#include "common/cuda_utils.cuh"
#include "layer_norm/layer_norm_kernels.cuh"
#include "rms_norm/rms_norm.h"
#include "rms_norm/rms_norm_cuda.cuh"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.rms_norm";

using cuda::aligned16;

using rms::has;
using rms::kernel_form;
using rms::kernel_weight;
using rms::kernels_take;
}  // namespace

RmsNormOutputs rms_norm_fwd_cuda(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                 const std::optional<at::Tensor>& weight,
                                 std::optional<double> eps, int64_t form,
                                 std::optional<at::ScalarType> out_dtype) {
  const auto rc = check_rms_norm_args(input, normalized_shape, weight, form, out_dtype);
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const RmsNormForm f = rms_norm_form(form);
  const at::ScalarType in = input.scalar_type();
  const at::ScalarType od = rms_norm_out_dtype(f, in, weight, out_dtype);
  if (!kernels_take(in, weight, od)) {
    return rms_norm_fwd_composite(input, normalized_shape, weight, eps, form, out_dtype);
  }
  const at::Tensor x = input.contiguous();
  const std::optional<at::Tensor> w = kernel_weight(weight, in);
  const auto sizes = input.sizes();
  at::Tensor y = at::empty(sizes, input.options().dtype(od));
  at::Tensor rstd = at::empty(sizes.slice(0, input.dim() - normalized_shape.size()),
                              input.options().dtype(at::kFloat));
  if (rc[0] == 0) return {y, rstd};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int cols = static_cast<int>(rc[1]);
  const int wk = ln::param_kind(w, in);
  const void* wp = ln::param_ptr(w);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(wp);
  const ln::RmsForm rf = kernel_form(f, in, weight);
  const float e = static_cast<float>(rms_norm_eps(eps, in));
  dispatch_dtype(in, kOp, [&](auto in_tag) {
    using T = typename decltype(in_tag)::type;
    dispatch_dtype(od, kOp, [&](auto out_tag) {
      using O = typename decltype(out_tag)::type;
      if constexpr (std::is_same_v<O, T>) {
        using Src = ln::PlainRows<T>;
        ln::launch_fwd<O, Src, true>(
            Src{x.data_ptr<T>()}, ln::fwd_vec_config<Src>(cols, aligned, "FASTLAYERS_RMS_FWD_TPR"),
            wp, nullptr, wk, ln::kParamNone, y.data_ptr<O>(), nullptr, rstd.data_ptr<float>(),
            rc[0], cols, e, kOp, stream, rf);
      }
    });
  });
  return {y, rstd};
}

RmsNormOutputs rms_norm_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                                 const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                 const std::optional<at::Tensor>& weight, int64_t form,
                                 std::array<bool, 2> output_mask) {
  check_rms_norm_backward_args(grad_out, input, rstd, normalized_shape, weight, form);
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const RmsNormForm f = rms_norm_form(form);
  const at::ScalarType in = input.scalar_type();
  if (!kernels_take(in, weight, grad_out.scalar_type()) || rstd.scalar_type() != at::kFloat) {
    return rms_norm_bwd_composite(grad_out, input, rstd, normalized_shape, weight, form,
                                  output_mask);
  }
  const int64_t rows = rstd.numel();
  const int cols = static_cast<int>(rows == 0 ? 0 : input.numel() / rows);
  const at::Tensor x = input.contiguous(), r = rstd.contiguous();
  const at::Tensor dy = grad_out.contiguous();  // the input's dtype (kernels_take)
  const std::optional<at::Tensor> w = kernel_weight(weight, in);
  const bool want_dw = output_mask[1] && has(weight);
  at::Tensor dx = output_mask[0] ? at::empty(input.sizes(), input.options())
                                 : at::empty({0}, input.options());
  at::Tensor dw = want_dw ? at::empty(normalized_shape, weight->options())
                          : at::empty({0}, input.options());
  if (rows == 0 || cols == 0) {
    if (want_dw) dw.zero_();
    return {dx, dw};
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int wk = ln::param_kind(w, in);
  const void* wp = ln::param_ptr(w);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) &&
                       aligned16(dx.data_ptr()) && aligned16(wp);
  const ln::RmsForm rf = kernel_form(f, in, weight);
  dispatch_dtype(in, kOp, [&](auto in_tag) {
    using T = typename decltype(in_tag)::type;
    dispatch_dtype(dy.scalar_type(), kOp, [&](auto g_tag) {
      using G = typename decltype(g_tag)::type;
      if constexpr (std::is_same_v<G, T>) {
        using Sink = ln::PlainSink<T>;
        const Sink sink{output_mask[0] ? dx.data_ptr<T>() : nullptr};
        ln::launch_bwd<T, G, Sink, true>(
            dy.data_ptr<G>(), x.data_ptr<T>(), nullptr, r.data_ptr<float>(), wp, wk, sink,
            aligned, want_dw ? dw : at::Tensor(), at::Tensor(), rows, cols,
            input.options().dtype(at::kFloat), "FASTLAYERS_RMS_BWD_TPR", kOp, stream, rf);
      }
    });
  });
  return {dx, dw};
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
}

}  // namespace fastlayers
