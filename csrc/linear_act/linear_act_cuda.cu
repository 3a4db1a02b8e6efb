// Fused Linear + activation CUDA kernels (GELU erf/tanh, ReLU).
//
// Forward, fused path (sm_90 GPUs, half/bf16, in/out features multiples of 8, enough rows): one
// CUTLASS GEMM whose epilogue adds the bias, stores the pre-activation when backward needs it,
// and writes the activation (linear_act_sm90.*). Fallback path (float32, float64, other GPUs, odd
// sizes, small batches): GELU: ATen's GEMM (cuBLAS, TF32 only where torch allows it) with the
// bias, then GELU in one elementwise pass (in double for float64), in place when the
// pre-activation is not kept. ReLU: ATen's _addmm_activation, which is cuBLASLt's bias + ReLU
// epilogue (one kernel) where cuBLASLt takes the call, else cuBLAS then ReLU in place.
// Backward: one pass computes dz = dL/dz (from z for GELU, from the output y for ReLU) and
// per-block column sums of dz (the bias gradient, summed afterwards in a fixed order:
// deterministic; backward_pass.cu), then cuBLAS GEMMs give dx, dw. This file: the path choice,
// the op implementations and the raw entries that _C._testing exposes.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/_addmm_activation.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "common/arch_check.h"
#include "common/common.h"
#include "common/cuda_utils.cuh"
#include "common/elementwise.cuh"
#include "gated_act/gated_act.h"
#include "linear_act/backward_pass.h"
#include "linear_act/linear_act.h"
#include "linear_act/sm80/linear_act_sm80.h"
#include "linear_act/sm90/linear_act_sm90.h"

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.linear_act";

struct ActForward {
  static constexpr bool kBinary = false;
  Activation act;
  template <typename C>  // float, or double for float64
  __device__ C operator()(C z, C) const {
    return activation_value(z, act);
  }
};

// ------------------------------------------------------------------------------------------
// Path choice and the sm90 launch.

bool aligned16(const std::optional<at::Tensor>& t) {
  return !t.has_value() || !t->defined() || cuda::aligned16(t->data_ptr());
}

// The forward's fallback: one cuBLASLt kernel (its RELU_BIAS epilogue: GEMM + bias + ReLU) for
// ReLU with a bias and no pre-activation kept, where cuBLASLt takes the call; a GEMM and an
// activation pass otherwise. Not for in_features = 0: _addmm_activation returned garbage there
// (H100, torch 2.11) instead of relu(bias).
sm90::Fallback forward_fallback(Activation act, bool has_bias, bool save_preact, int64_t k) {
  return act == Activation::kReLU && has_bias && !save_preact && k > 0
             ? sm90::Fallback::kOneKernel
             : sm90::Fallback::kGemmAndPass;
}

// Why no fused CUTLASS kernel (sm90 or sm80) can take a call of this dtype and these sizes,
// whatever the GPU (nullptr: one can, if its tensors are aligned).
const char* fused_gemm_unfit(at::ScalarType dtype, const LinearDims& d) {
  if (dtype == at::kFloat) return "float32 input";
  if (dtype == at::kDouble) return "float64 input";
  if (d.k == 0 || d.k % 8 != 0 || d.n % 8 != 0)
    return "in_features and out_features must be positive multiples of 8";
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  if (d.m > kIntMax || d.n > kIntMax || d.k > kIntMax) return "a dimension exceeds 2^31 - 1";
  return nullptr;
}

// Why no fused CUTLASS kernel (sm90 or sm80) can take this call, whatever the GPU: dtype, sizes
// and alignment (nullptr: one can). x2 is [m, k] contiguous.
const char* fused_gemm_ineligible(const at::Tensor& x2, const at::Tensor& w,
                                  const std::optional<at::Tensor>& bias, const LinearDims& d) {
  if (const char* why = fused_gemm_unfit(x2.scalar_type(), d)) return why;
  if (!aligned16(x2) || !aligned16(w) || !aligned16(bias))
    return "input, weight or bias is not 16-byte aligned";
  return nullptr;
}

// Why the sm90 kernels cannot run on this device (nullptr: they can).
const char* sm90_device_unfit(int device) {
  if (!sm90::kernels_built()) return "this build has no sm_90a CUTLASS kernels";
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  if (prop->major != 9 || prop->minor != 0) return "the GPU is not sm_90 (H100/H200)";
  return nullptr;
}

// The size rule's refusal on this device (nullptr: it takes the call); none: any size.
const char* sm90_size_unfit(int device, const LinearDims& d,
                            std::optional<sm90::Fallback> size_rule) {
  if (!size_rule) return nullptr;
  const int sms = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  return sm90::size_refusal(d.m, d.n, d.k, sms, *size_rule);
}

// Why the fused sm90 kernel cannot take this call (nullptr: it can). x2 is [m, k] contiguous.
// size_rule: the fallback the size rule weighs the call against; none: any size.
const char* sm90_ineligible(const at::Tensor& x2, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, const LinearDims& d,
                            std::optional<sm90::Fallback> size_rule) {
  if (const char* why = sm90_device_unfit(x2.get_device())) return why;
  if (const char* why = fused_gemm_ineligible(x2, w, bias, d)) return why;
  return sm90_size_unfit(x2.get_device(), d, size_rule);
}

// Why the fused sm80 kernel cannot take this call (nullptr: it can). By default (forced = false)
// it serves compute capability 8.x, sized by its size rule; forced (the raw entry, e.g. on an
// H100): any GPU it runs on (8.0 and newer), any size.
const char* sm80_ineligible(const at::Tensor& x2, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, const LinearDims& d,
                            bool forced) {
  if (!sm80::kernels_built()) return "this build has no sm_80 CUTLASS kernels";
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(x2.get_device());
  if (forced ? prop->major < 8 : prop->major != 8)
    return forced ? "the GPU is older than compute capability 8.0"
                  : "the GPU is not compute capability 8.x";
  if (const char* why = fused_gemm_ineligible(x2, w, bias, d)) return why;
  return forced ? nullptr : sm80::size_refusal(d.m, d.n, d.k, prop->multiProcessorCount);
}

// The fused kernel a forward call runs, or none with the reason.
enum class FusedKernel { kSm90, kSm80, kNone };
struct ForwardPath {
  FusedKernel kernel;
  const char* why;  // kNone: why no fused kernel takes the call
};

// sm_90 GPUs: the sm90 kernel by its size rule. 8.x: the sm80 kernel, where the fallback is a GEMM
// and an activation pass (cuBLASLt's one-kernel GEMM + bias + ReLU is that fusion already, with
// cuBLAS's own mainloop).
ForwardPath forward_path(const at::Tensor& x2, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias, const LinearDims& d,
                         sm90::Fallback fallback) {
  const char* why = sm90_ineligible(x2, w, bias, d, fallback);
  if (why == nullptr) return {FusedKernel::kSm90, nullptr};
  if (at::cuda::getDeviceProperties(x2.get_device())->major != 8) return {FusedKernel::kNone, why};
  if (fallback == sm90::Fallback::kOneKernel)
    return {FusedKernel::kNone, "ReLU with a bias: cuBLASLt's GEMM + bias + ReLU kernel"};
  why = sm80_ineligible(x2, w, bias, d, /*forced=*/false);
  return {why == nullptr ? FusedKernel::kSm80 : FusedKernel::kNone, why};
}

// The CUTLASS kernels' dtype of a half or bfloat16 tensor.
sm90::Dtype gemm_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? sm90::Dtype::kBFloat16 : sm90::Dtype::kHalf;
}

// Runs a prepared sm90 problem on the current stream (device, SM count and workspace filled in
// here); errors name the op.
void launch_sm90(sm90::Problem& p, at::ScalarType dtype, const at::TensorOptions& opts) {
  p.sm_count = at::cuda::getDeviceProperties(p.device)->multiProcessorCount;
  const sm90::Dtype sm90_dtype = gemm_dtype(dtype);
  const size_t ws = sm90::workspace_bytes(sm90_dtype, p);
  at::Tensor workspace;
  if (ws > 0) workspace = at::empty({static_cast<int64_t>(ws)}, opts.dtype(at::kByte));
  const char* err = sm90::run(sm90_dtype, p, ws > 0 ? workspace.data_ptr() : nullptr,
                              at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, kOp, ": ", err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The forward problem y = act(x2 . W^T + bias), preact = x2 . W^T + bias when not null.
sm90::Problem forward_problem(const at::Tensor& x2, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias, const at::Tensor& y,
                              const at::Tensor* preact, bool weight_transposed,
                              Activation epilogue) {
  sm90::Problem p;
  p.x = x2.data_ptr();
  p.w = w.data_ptr();
  p.bias = bias.has_value() && bias->defined() ? bias->data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.preact = preact ? preact->data_ptr() : nullptr;
  p.m = static_cast<int>(x2.size(0));
  p.k = static_cast<int>(x2.size(1));
  p.n = static_cast<int>(y.numel() / std::max<int64_t>(1, x2.size(0)));
  p.w_transposed = weight_transposed;
  p.epilogue = epilogue;
  p.device = x2.get_device();
  return p;
}

// keep_derivative: preact gets act'(z) instead of z (Pass::kForwardKeepDerivative).
void run_sm90(const at::Tensor& x2, const at::Tensor& w, const std::optional<at::Tensor>& bias,
              const at::Tensor& y, const at::Tensor* preact, bool weight_transposed,
              Activation epilogue, sm90::Config config, bool keep_derivative = false) {
  sm90::Problem p = forward_problem(x2, w, bias, y, preact, weight_transposed, epilogue);
  p.config = config;
  if (keep_derivative) p.pass = sm90::Pass::kForwardKeepDerivative;
  launch_sm90(p, x2.scalar_type(), x2.options());
}

void run_sm80(const at::Tensor& x2, const at::Tensor& w, const std::optional<at::Tensor>& bias,
              const at::Tensor& y, const at::Tensor* preact, bool weight_transposed,
              Activation epilogue, sm80::Config config) {
  const sm90::Problem p = forward_problem(x2, w, bias, y, preact, weight_transposed, epilogue);
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(p.device);
  const sm80::Gpu gpu{prop->multiProcessorCount, prop->sharedMemPerBlockOptin,
                      prop->sharedMemPerMultiprocessor};
  const sm90::Dtype dtype = gemm_dtype(x2.scalar_type());
  const size_t ws = sm80::workspace_bytes(dtype, p, config, gpu);
  at::Tensor workspace;
  if (ws > 0) workspace = at::empty({static_cast<int64_t>(ws)}, x2.options().dtype(at::kByte));
  const char* err = sm80::run(dtype, p, config, gpu, ws > 0 ? workspace.data_ptr() : nullptr,
                              at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, kOp, ": ", err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The backward GEMM dz = act'(saved) * (dy2 . W2), the derivative in its epilogue. dy2 [m, n2],
// saved2 [m, n1], dz [m, n1] contiguous; w2 as the layer stores it.
// Runs the sm90 backward GEMM into dz; with want_db, also returns the GEMM's column sums of dz
// (float, before rounding) per warp of each row tile, [column_partial_rows, n], for
// finish_bias_grads; else an undefined tensor.
// gated: the kernel's other epilogue, dz = act(saved) * (dy2 . W2) (gated_act_linear).
at::Tensor run_sm90_dgrad(const at::Tensor& dy2, const at::Tensor& w2, const at::Tensor& saved2,
                          const at::Tensor& dz, bool weight_transposed, Activation act,
                          sm90::Config config, bool want_db, bool gated = false) {
  sm90::Problem p;
  p.pass = sm90::Pass::kDgrad;
  p.gated = gated;
  p.x = dy2.data_ptr();
  p.w = w2.data_ptr();
  p.saved = saved2.data_ptr();
  p.y = dz.data_ptr();
  p.m = static_cast<int>(dy2.size(0));
  p.k = static_cast<int>(dy2.size(1));
  p.n = static_cast<int>(saved2.size(1));
  // dy2 . W2 with W2 = w2 [n2, n1] = [k, n] (the GEMM's "transposed" B), or w2 stored
  // [n1, n2] = [n, k] for a Conv1D layer
  p.w_transposed = !weight_transposed;
  p.epilogue = act;
  p.config = config;
  p.device = dy2.get_device();
  at::Tensor partials;
  if (want_db) {
    p.sm_count = at::cuda::getDeviceProperties(p.device)->multiProcessorCount;
    partials = at::empty({sm90::column_partial_rows(p), p.n}, dy2.options().dtype(at::kFloat));
    p.col_partials = partials.data_ptr<float>();
  }
  launch_sm90(p, dy2.scalar_type(), dy2.options());
  return partials;
}

std::optional<at::Tensor> contiguous_bias(const std::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return std::nullopt;
  return bias->contiguous();
}

}  // namespace


LinearActOutputs linear_act_fwd_cuda(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     c10::string_view activation, bool weight_transposed,
                                     bool save_preact, bool save_derivative) {
  const LinearDims d = check_linear_act_args(input, weight, bias, weight_transposed);
  const Activation act = parse_activation(activation);
  check_save_args(act, save_preact, save_derivative);
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const bool keep = save_preact || save_derivative;  // a second [..., n] output
  const auto out_shape = linear_act_out_shape(input, d.n);
  const auto opts = input.options();
  const auto new_preact = [&] { return keep ? at::empty(out_shape, opts) : at::empty({0}, opts); };
  if (d.m == 0 || d.n == 0) return {at::empty(out_shape, opts), new_preact()};
  const at::Tensor x2 = input.reshape({d.m, d.k}).contiguous();
  const at::Tensor w = weight.contiguous();
  const std::optional<at::Tensor> b = contiguous_bias(bias);
  const sm90::Fallback fallback = forward_fallback(act, b.has_value(), keep, d.k);
  const ForwardPath path = forward_path(x2, w, b, d, fallback);
  if (path.kernel != FusedKernel::kNone) {
    at::Tensor y = at::empty(out_shape, opts);
    at::Tensor preact = new_preact();
    const at::Tensor* pre = keep ? &preact : nullptr;
    if (path.kernel == FusedKernel::kSm90) {
      // the epilogue computes the derivative beside the activation
      run_sm90(x2, w, b, y, pre, weight_transposed, act, sm90::Config::kAuto, save_derivative);
      return {y, preact};
    }
    run_sm80(x2, w, b, y, pre, weight_transposed, act, sm80::Config::kAuto);
    return {y, save_derivative ? activation_derivative(preact, act) : preact};
  }
  const char* why = path.why;
  const int device = input.get_device();
  const bool half = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  if (sm90_device_unfit(device) == nullptr && half &&
      sm90_size_unfit(device, d, fallback) == nullptr) {
    TORCH_WARN_ONCE(kOp, ": ", why, "; this call and others like it run a cuBLAS GEMM and the ",
                    "activation outside the fused kernel, slower than the fused kernel");
  }
  const at::Tensor wt = weight_transposed ? w : w.t();
  if (fallback == sm90::Fallback::kOneKernel) {
    // where cuBLASLt does not take the call, ATen runs its GEMM and relu_ (the same values)
    return {at::_addmm_activation(*b, x2, wt, 1, 1, /*use_gelu=*/false).view(out_shape),
            at::empty({0}, opts)};
  }
  // z = x . W^T + bias by ATen (as F.linear: cuBLASLt with its bias epilogue; addmm_out would
  // first copy the bias into the output, one more pass), then the activation in one pass, in
  // place when backward does not need z. One 16-byte vector per thread, as ATen's GELU: with
  // eight (H100, bench_linear_gelu.py --few-rows) the erf pass left SMs idle and made 8192 x
  // 3072 -> 768 4% slower than eager (70.0 against 67.3 us); ATen's own in-place GELU there
  // matched eager but read 4-6 us slower per call at ~17 us problems (640 x 768 -> 3072; its
  // dispatch, most likely: not profiled).
  const at::Tensor z = b.has_value() ? at::addmm(*b, x2, wt) : at::mm(x2, wt);
  at::Tensor y = keep ? at::empty(out_shape, opts) : z.view(out_shape);
  dispatch_dtype_f64(input.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_elementwise<1>(z.data_ptr<T>(), static_cast<const T*>(nullptr), y.data_ptr<T>(),
                                y.numel(), ActForward{act}, kOp);
  });
  if (save_derivative) return {y, activation_derivative(z.view(out_shape), act)};
  return {y, save_preact ? z.view(out_shape) : at::empty({0}, opts)};
}

bool linear_act_keeps_derivative(const at::Tensor& input, const at::Tensor& weight,
                                 bool has_bias, Activation act, bool weight_transposed) {
  if (!input.is_cuda() || (act != Activation::kGeluErf && act != Activation::kGeluTanh))
    return false;
  if (sm90_device_unfit(input.get_device()) != nullptr) return false;
  const LinearDims d{rows_of(input), input.size(-1), weight.size(weight_transposed ? 1 : 0)};
  if (d.m == 0 || fused_gemm_unfit(input.scalar_type(), d) != nullptr) return false;
  const sm90::Fallback fallback = forward_fallback(act, has_bias, /*save_preact=*/true, d.k);
  return sm90_size_unfit(input.get_device(), d, fallback) == nullptr;
}

LinearActGrads linear_act_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& saved,
                                   const at::Tensor& input, const at::Tensor& weight,
                                   bool has_bias, c10::string_view activation,
                                   bool weight_transposed, std::array<bool, 3> output_mask) {
  const LinearDims d =
      check_linear_act_backward_args(grad_out, saved, input, weight, weight_transposed);
  const Activation act = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const bool want_dx = output_mask[0], want_dw = output_mask[1];
  const bool want_db = output_mask[2] && has_bias;
  const bool need_dz = want_dx || want_dw;
  const auto opts = input.options();
  const at::Tensor dy = grad_out.reshape({d.m, d.n}).contiguous();
  const at::Tensor s = saved.reshape({d.m, d.n}).contiguous();
  at::Tensor dz = need_dz ? at::empty({d.m, d.n}, opts) : at::Tensor();
  at::Tensor db;
  if (need_dz || want_db) db = launch_dact(dy, s, dz, want_db, act);
  return linear_act_grads_from_dz(dz, db, input, weight, d, weight_transposed, want_dx, want_dw);
}

namespace {

// Why the sm90 backward GEMM cannot take this linear_act_dgrad call (nullptr: it can): the
// forward kernel's conditions with dy2 as its input, and an aligned saved tensor.
const char* sm90_dgrad_ineligible(const at::Tensor& dy2, const at::Tensor& w2,
                                  const at::Tensor& saved2, const LinearDims& d,
                                  bool check_size = true) {
  // its fallback is a cuBLAS GEMM and the backward pass (dz and the bias gradient)
  const auto size_rule =
      check_size ? std::optional(sm90::Fallback::kGemmAndGradPass) : std::nullopt;
  const char* why = sm90_ineligible(dy2, w2, std::nullopt, d, size_rule);
  if (why == nullptr && !cuda::aligned16(saved2.data_ptr())) return "saved is not 16-byte aligned";
  return why;
}

// The backward GEMM's fallback: cuBLAS for dy . W2, then the elementwise backward pass, which
// writes dz and sums the bias gradient in the same pass. Returns (dz, db), db empty unless want_db.
std::tuple<at::Tensor, at::Tensor> dgrad_by_cublas(const at::Tensor& dy2, const at::Tensor& w2,
                                                   const at::Tensor& s2, const at::Tensor& dz,
                                                   bool weight_transposed, Activation act,
                                                   bool want_db) {
  const at::Tensor da = at::mm(dy2, weight_transposed ? w2.t() : w2);
  const at::Tensor db = launch_dact(da, s2, dz, want_db, act);
  return {dz, want_db ? db : at::empty({0}, dz.options())};
}

}  // namespace

DgradOutputs linear_act_dgrad_cuda(const at::Tensor& grad_out, const at::Tensor& weight,
                                   const at::Tensor& saved, c10::string_view activation,
                                   bool weight_transposed, bool want_db, bool saved_is_derivative,
                                   bool want_grad_out_sums) {
  const LinearDims d = check_linear_act_dgrad_args(grad_out, weight, saved, weight_transposed);
  const Activation act = dgrad_form(activation, saved_is_derivative);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  check_kernel_image(grad_out.get_device(), kOp);
  const auto opts = saved.options();
  const at::Tensor no_db = at::empty({0}, opts);
  if (d.m == 0 || d.n == 0) {
    return {at::empty(saved.sizes(), opts), want_db ? at::zeros({d.n}, opts) : no_db,
            want_grad_out_sums ? column_sums(grad_out.reshape({d.m, d.k}).contiguous()) : no_db};
  }
  const at::Tensor dy2 = grad_out.reshape({d.m, d.k}).contiguous();
  const at::Tensor w2 = weight.contiguous();
  const at::Tensor s2 = saved.reshape({d.m, d.n}).contiguous();
  at::Tensor dz = at::empty({d.m, d.n}, opts);
  if (sm90_dgrad_ineligible(dy2, w2, s2, d) == nullptr) {
    // grad_out's column sums by the backward pass's reduction before the GEMM (grad_out is then
    // still in L2 from the caller's weight-gradient GEMM: 6.2-6.6 us against 7.8-8.0 after it
    // at BERT-base, H100); their finish shares one launch with db's (the GEMM's tile partials)
    const DactSums out_sums = want_grad_out_sums
                                  ? launch_dact_pass(dy2, at::Tensor(), at::Tensor(),
                                                     /*want_db=*/true, Activation::kIdentity)
                                  : DactSums{};
    const at::Tensor partials =
        run_sm90_dgrad(dy2, w2, s2, dz, weight_transposed, act, sm90::Config::kAuto, want_db);
    const at::Tensor db = finish_bias_grads(partials, saved.scalar_type(), out_sums);
    return {dz.view(saved.sizes()), want_db ? db : no_db,
            want_grad_out_sums ? out_sums.db : no_db};
  }
  const auto [dz2, db] = dgrad_by_cublas(dy2, w2, s2, dz, weight_transposed, act, want_db);
  return {dz2.view(saved.sizes()), db, want_grad_out_sums ? column_sums(dy2) : no_db};
}

at::Tensor column_sums_cuda(const at::Tensor& grad) {
  check_column_sums_args(grad);
  const c10::cuda::CUDAGuard guard(grad.device());
  check_kernel_image(grad.get_device(), "fastlayers.column_sums");
  return column_sums(grad.reshape({rows_of(grad), grad.size(-1)}).contiguous());
}

std::string linear_act_dgrad_cuda_path(const at::Tensor& grad_out, const at::Tensor& weight,
                                       const at::Tensor& saved, c10::string_view activation,
                                       bool weight_transposed) {
  const LinearDims d = check_linear_act_dgrad_args(grad_out, weight, saved, weight_transposed);
  parse_activation(activation);
  TORCH_CHECK(grad_out.is_cuda(), kOp, ": the path query is for CUDA tensors, grad_out is on ",
              grad_out.device().str());
  const c10::cuda::CUDAGuard guard(grad_out.device());
  check_kernel_image(grad_out.get_device(), kOp);
  const char* why = sm90_dgrad_ineligible(grad_out.reshape({d.m, d.k}).contiguous(),
                                          weight.contiguous(),
                                          saved.reshape({d.m, d.n}).contiguous(), d);
  return why == nullptr ? std::string("cutlass_sm90") : std::string("fallback: ") + why;
}

std::string linear_act_cuda_path(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, c10::string_view activation,
                                 bool weight_transposed) {
  const LinearDims d = check_linear_act_args(input, weight, bias, weight_transposed);
  const Activation act = parse_activation(activation);
  TORCH_CHECK(input.is_cuda(), kOp, ": the path query is for CUDA tensors, input is on ",
              input.device().str());
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const at::Tensor x2 = input.reshape({d.m, d.k}).contiguous();
  const std::optional<at::Tensor> b = contiguous_bias(bias);
  const sm90::Fallback fallback = forward_fallback(act, b.has_value(), false, d.k);
  const ForwardPath path = forward_path(x2, weight.contiguous(), b, d, fallback);
  if (path.kernel == FusedKernel::kSm90) return "cutlass_sm90";
  if (path.kernel == FusedKernel::kSm80) return "cutlass_sm80";
  return std::string("fallback: ") + path.why;
}

namespace {

// The raw forward entries' argument checks (2-D contiguous tensors, y [m, n] in the input dtype,
// preact shaped like y, epilogue and config in range); returns the dimensions.
LinearDims check_raw_forward_args(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const at::Tensor& y,
                                  const std::optional<at::Tensor>& preact, bool weight_transposed,
                                  int64_t epilogue, int64_t config, int num_configs,
                                  const char* kernel) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && y.is_contiguous(),
              kOp, ": the raw ", kernel, " entry takes 2-D contiguous tensors");
  const LinearDims d = check_linear_act_args(x, weight, bias, weight_transposed);
  TORCH_CHECK(y.sizes() == at::IntArrayRef({d.m, d.n}) && y.scalar_type() == x.scalar_type(),
              kOp, ": y must be [m, n] in the input dtype");
  TORCH_CHECK(!preact.has_value() || preact->sizes() == y.sizes(), kOp,
              ": preact must be shaped like y");
  constexpr int64_t kLast = static_cast<int64_t>(Activation::kIdentity);
  TORCH_CHECK(epilogue >= 0 && epilogue <= kLast && config >= -1 && config < num_configs, kOp,
              ": epilogue must be 0..", std::to_string(kLast), " and config -1..",
              std::to_string(num_configs - 1));
  return d;
}

}  // namespace

void linear_act_sm90_raw(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const at::Tensor& y,
                         const std::optional<at::Tensor>& preact, bool weight_transposed,
                         int64_t epilogue, int64_t config) {
  const LinearDims d = check_raw_forward_args(x, weight, bias, y, preact, weight_transposed,
                                              epilogue, config, sm90::kNumConfigs, "sm90");
  const c10::cuda::CUDAGuard guard(x.device());
  check_kernel_image(x.get_device(), kOp);
  const char* why = sm90_ineligible(x, weight, bias, d, /*size_rule=*/std::nullopt);
  TORCH_CHECK(why == nullptr, kOp, ": the sm90 kernel cannot run this: ", why);
  const auto cfg = static_cast<sm90::Config>(config);
  const sm90::Dtype dtype = gemm_dtype(x.scalar_type());
  TORCH_CHECK(sm90::config_available(sm90::Pass::kForward, dtype, weight_transposed, cfg), kOp,
              ": config ", std::to_string(config), " is not compiled for this dtype and weight "
              "layout");
  const at::Tensor* pre = preact.has_value() ? &*preact : nullptr;
  run_sm90(x, weight, bias, y, pre, weight_transposed, static_cast<Activation>(epilogue), cfg);
}

void linear_act_sm80_raw(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const at::Tensor& y,
                         const std::optional<at::Tensor>& preact, bool weight_transposed,
                         int64_t epilogue, int64_t config) {
  const LinearDims d = check_raw_forward_args(x, weight, bias, y, preact, weight_transposed,
                                              epilogue, config, sm80::kNumConfigs, "sm80");
  const c10::cuda::CUDAGuard guard(x.device());
  check_kernel_image(x.get_device(), kOp);
  const char* why = sm80_ineligible(x, weight, bias, d, /*forced=*/true);
  TORCH_CHECK(why == nullptr, kOp, ": the sm80 kernel cannot run this: ", why);
  const auto cfg = static_cast<sm80::Config>(config);
  TORCH_CHECK(sm80::config_available(gemm_dtype(x.scalar_type()), weight_transposed, cfg), kOp,
              ": config ", std::to_string(config), " is not compiled for this dtype and weight "
              "layout");
  const char* no_room = sm80::shared_memory_refusal(
      cfg, at::cuda::getDeviceProperties(x.get_device())->sharedMemPerBlockOptin);
  TORCH_CHECK(no_room == nullptr, kOp, ": config ", std::to_string(config), ": ", no_room);
  const at::Tensor* pre = preact.has_value() ? &*preact : nullptr;
  run_sm80(x, weight, bias, y, pre, weight_transposed, static_cast<Activation>(epilogue), cfg);
}

at::Tensor linear_act_dgrad_sm90_raw(const at::Tensor& grad_out, const at::Tensor& weight,
                                     const at::Tensor& saved, const at::Tensor& dz,
                                     bool weight_transposed, int64_t epilogue, int64_t config,
                                     bool want_db) {
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.is_contiguous() && weight.is_contiguous() &&
                  saved.dim() == 2 && saved.is_contiguous() && dz.is_contiguous(),
              kOp, ": the raw sm90 dgrad entry takes 2-D contiguous tensors");
  const LinearDims d = check_linear_act_dgrad_args(grad_out, weight, saved, weight_transposed);
  TORCH_CHECK(dz.sizes() == saved.sizes() && dz.scalar_type() == saved.scalar_type(), kOp,
              ": dz must be shaped like saved, in its dtype");
  constexpr int64_t kLast = static_cast<int64_t>(Activation::kSavedDerivative);
  TORCH_CHECK(epilogue >= 0 && epilogue <= kLast && config >= -1 && config < sm90::kNumConfigs,
              kOp, ": epilogue must be 0..", std::to_string(kLast), " and config -1..",
              std::to_string(sm90::kNumConfigs - 1));
  const c10::cuda::CUDAGuard guard(grad_out.device());
  check_kernel_image(grad_out.get_device(), kOp);
  const char* why = sm90_dgrad_ineligible(grad_out, weight, saved, d, /*check_size=*/false);
  TORCH_CHECK(why == nullptr, kOp, ": the sm90 dgrad kernel cannot run this: ", why);
  const at::Tensor partials =
      run_sm90_dgrad(grad_out, weight, saved, dz, weight_transposed,
                     static_cast<Activation>(epilogue), static_cast<sm90::Config>(config), want_db);
  return want_db ? finish_bias_grads(partials, saved.scalar_type())
                 : at::empty({0}, saved.options());
}

std::tuple<at::Tensor, at::Tensor> linear_act_dgrad_fallback_raw(
    const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& saved,
    bool weight_transposed, int64_t epilogue, bool want_db) {
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.is_contiguous() && weight.is_contiguous() &&
                  saved.dim() == 2 && saved.is_contiguous(),
              kOp, ": the raw dgrad fallback entry takes 2-D contiguous tensors");
  const LinearDims d = check_linear_act_dgrad_args(grad_out, weight, saved, weight_transposed);
  constexpr int64_t kLast = static_cast<int64_t>(Activation::kIdentity);
  TORCH_CHECK(epilogue >= 0 && epilogue < kLast, kOp, ": epilogue must be 0..",
              std::to_string(kLast - 1));
  TORCH_CHECK(d.m > 0 && d.n > 0, kOp, ": the raw dgrad fallback entry needs a non-empty output");
  const c10::cuda::CUDAGuard guard(grad_out.device());
  check_kernel_image(grad_out.get_device(), kOp);
  return dgrad_by_cublas(grad_out, weight, saved, at::empty_like(saved), weight_transposed,
                         static_cast<Activation>(epilogue), want_db);
}

// ------------------------------------------------------------------------------------------
// gated_act_linear: a gated MLP's up projection with act(gate) * up in its epilogue, on the sm90
// backward-GEMM kernel (its epilogue reads a second [m, n] operand by TMA; Problem::gated).

namespace {

constexpr const char* kGatedOp = "fastlayers.gated_act_linear";

// Why the sm90 epilogue cannot take this call (nullptr: it can). x2 [m, k], w [n, k] and g2
// [m, n] contiguous. The size rule weighs the call against cuBLAS's GEMM and an elementwise pass.
const char* gated_linear_ineligible(const at::Tensor& x2, const at::Tensor& w,
                                    const at::Tensor& g2, const LinearDims& d, Activation act) {
  // gated_product (linear_act_sm90.cuh) computes these two only
  if (act != Activation::kSiLU && act != Activation::kGeluTanh)
    return "the epilogue computes SiLU and tanh GELU only";
  if (d.m == 0 || d.n == 0) return "an empty output";
  // the backward GEMM's own checks (W stored [n, k]: its "transposed" layout), size aside
  if (const char* why = sm90_dgrad_ineligible(x2, w, g2, d, /*check_size=*/false)) return why;
  if (const char* why = sm90_size_unfit(x2.get_device(), d, sm90::Fallback::kGemmAndPass))
    return why;
  // Where the size rule picks the cooperative 256x128 tiles (in_features over 2048 and rows
  // enough to fill their waves), no second warp group's mainloop hides the epilogue: there the
  // product costs more than gated_act's pass (H200, bf16, 8192 x 4096 -> 14336 SiLU: 1,690
  // against 1,579 us; the ping-pong tiles at 2048 -> 5632: 274 against 340-356 us).
  const int sms = at::cuda::getDeviceProperties(x2.get_device())->multiProcessorCount;
  if (sm90::auto_config(d.m, d.n, d.k, sms, sm90::Pass::kDgrad) == sm90::Config::kCoop256x128)
    return "cooperative 256x128 tiles (in_features over 2048), whose epilogue the mainloop does "
           "not hide";
  return nullptr;
}

}  // namespace

at::Tensor gated_act_linear_cuda(const at::Tensor& gate, const at::Tensor& input,
                                 const at::Tensor& weight, c10::string_view activation) {
  const Activation act = parse_gated_activation(activation);
  const LinearDims d = check_gated_act_linear_args(gate, input, weight);
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kGatedOp);
  const at::Tensor x2 = input.reshape({d.m, d.k}).contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor g2 = gate.reshape({d.m, d.n}).contiguous();
  if (gated_linear_ineligible(x2, w, g2, d, act) != nullptr)
    return gated_act_fwd_cuda(gate, at::linear(input, weight), activation);
  at::Tensor y = at::empty(gate.sizes(), gate.options());  // contiguous: [m, n]
  // x2 . W^T with W stored [n, k]: the backward GEMM's layout for a weight stored transposed
  run_sm90_dgrad(x2, w, g2, y, /*weight_transposed=*/true, act, sm90::Config::kAuto,
                 /*want_db=*/false, /*gated=*/true);
  return y;
}

std::string gated_act_linear_cuda_path(const at::Tensor& gate, const at::Tensor& input,
                                       const at::Tensor& weight, c10::string_view activation) {
  const Activation act = parse_gated_activation(activation);
  const LinearDims d = check_gated_act_linear_args(gate, input, weight);
  TORCH_CHECK(input.is_cuda(), kGatedOp, ": the path query is for CUDA tensors, input is on ",
              input.device().str());
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kGatedOp);
  const char* why =
      gated_linear_ineligible(input.reshape({d.m, d.k}).contiguous(), weight.contiguous(),
                              gate.reshape({d.m, d.n}).contiguous(), d, act);
  return why == nullptr ? std::string("cutlass_sm90") : std::string("fallback: ") + why;
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("linear_act_fwd", &linear_act_fwd_cuda);
  m.impl("linear_act_bwd", &linear_act_bwd_cuda);
  m.impl("linear_act_dgrad", &linear_act_dgrad_cuda);
  m.impl("column_sums", &column_sums_cuda);
  m.impl("gated_act_linear", &gated_act_linear_cuda);
}

}  // namespace fastlayers
