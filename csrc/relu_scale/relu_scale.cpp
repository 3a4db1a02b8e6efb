// ReLUScale op family: y = relu(x) * alpha in one pass.
//
//   relu_scale(input, alpha) -> y
//   relu_scale_(input!, alpha) -> ()                 in place
//   relu_scale_backward(grad_out, result, alpha) -> grad_input
//
// The backward needs only the forward's result (its sign), never a saved copy of x.
#include "relu_scale/relu_scale.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.relu_scale";
}  // namespace

void check_relu_scale_input(const at::Tensor& t, const char* arg) {
  check_input_dtype(t, kOp, arg);
}

void check_relu_scale_backward_args(const at::Tensor& grad_out, const at::Tensor& result) {
  check_input_dtype(grad_out, kOp, "grad_out");
  check_input_dtype(result, kOp, "result");
  check_same_device(grad_out, result, kOp, "grad_out", "result");
  TORCH_CHECK(grad_out.sizes() == result.sizes(), kOp, ": grad_out has shape ",
              shape_str(grad_out.sizes()), " but result has shape ", shape_str(result.sizes()));
  TORCH_CHECK(grad_out.scalar_type() == result.scalar_type(), kOp, ": grad_out has dtype ",
              grad_out.scalar_type(), " but result has dtype ", result.scalar_type());
}

namespace {

// CPU kernels over contiguous buffers, in C = at::opmath_type<T> (float, or double for float64).
template <typename T>
void relu_scale_cpu_kernel(const T* x, T* y, int64_t n, double alpha) {
  using C = at::opmath_type<T>;
  const C a = static_cast<C>(alpha);
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      y[i] = static_cast<T>(relu_scale_value<C>(static_cast<C>(x[i]), a));
  });
}

// float16/bfloat16 on CPU take ATen's vectorised kernels instead: torch.relu(x) * alpha exactly
// as native computes it (relu, then the product in float, skipped for alpha = 1 where it changes
// nothing). The loop above converts each half by hand (no F16C in this build) and ran 7x slower
// than torch.relu (benchmarks/bench_cpu.py). alpha = 1 (a swapped nn.ReLU) is torch.relu itself
// in every dtype: our loop measured 0.95-0.98x of it. Other float32/float64 calls keep the
// one-pass loop (2.2x faster than relu then multiply).
bool aten_relu_on_cpu(const at::Tensor& t, double alpha) {
  return alpha == 1.0 || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// alpha as Python passes `* alpha` (a wrapped 0-dim float64 tensor, second operand): the product
// then runs in float with float(alpha), as native's; Tensor::mul_(Scalar) rounds alpha to the
// tensor's half dtype first (a different result, e.g. for -0.7).
at::Tensor wrapped_alpha(double alpha) {
  at::Tensor t = at::scalar_tensor(alpha, at::TensorOptions().dtype(at::kDouble));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

at::Tensor relu_scale_cpu(const at::Tensor& input, double alpha) {
  check_relu_scale_input(input, "input");
  if (aten_relu_on_cpu(input, alpha)) {
    // contiguous: at::relu keeps a permuted input's strides, the fake kernel (and CUDA) do not
    at::Tensor y = at::relu(input.contiguous());
    return alpha == 1.0 ? y : y.mul(wrapped_alpha(alpha));  // out of place, as native
  }
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  dispatch_dtype_f64(x.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    relu_scale_cpu_kernel<T>(x.data_ptr<T>(), y.data_ptr<T>(), x.numel(), alpha);
  });
  return y;
}

void relu_scale_inplace_cpu(const at::Tensor& input, double alpha) {
  check_relu_scale_input(input, "input");
  if (!input.is_non_overlapping_and_dense()) {
    // A view whose elements share memory (partially overlapping strides): ATen's relu_ then
    // mul_ would multiply a shared location once per element that reads it (alpha^2 there);
    // every location must get relu(x) * alpha of its value before the call, once.
    input.copy_(relu_scale_cpu(input, alpha));
    return;
  }
  if (aten_relu_on_cpu(input, alpha)) {
    input.relu_();
    if (alpha != 1.0) input.mul_(wrapped_alpha(alpha));
    return;
  }
  if (!input.is_contiguous()) {  // dense but permuted: the loop below reads memory in order
    input.copy_(relu_scale_cpu(input, alpha));
    return;
  }
  dispatch_dtype_f64(input.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    relu_scale_cpu_kernel<T>(input.data_ptr<T>(), input.data_ptr<T>(), input.numel(), alpha);
  });
}

at::Tensor relu_scale_backward_cpu(const at::Tensor& grad_out, const at::Tensor& result,
                                   double alpha) {
  check_relu_scale_backward_args(grad_out, result);
  if (aten_relu_on_cpu(grad_out, alpha) && alpha > 0) {
    // native's backward of relu(x) * alpha: grad * alpha where the result is > 0 or NaN, else 0
    // contiguous operands, so dx is contiguous as the fake kernel says
    const at::Tensor dy = grad_out.contiguous();
    const at::Tensor g = alpha == 1.0 ? dy : dy.mul(wrapped_alpha(alpha));
    return at::threshold_backward(g, result.contiguous(), 0);
  }
  const at::Tensor dy = grad_out.contiguous(), r = result.contiguous();
  at::Tensor dx = at::empty(dy.sizes(), dy.options());
  dispatch_dtype_f64(dy.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = at::opmath_type<T>;
    const C a = static_cast<C>(alpha);
    const T* g = dy.data_ptr<T>();
    const T* rp = r.data_ptr<T>();
    T* out = dx.data_ptr<T>();
    at::parallel_for(0, dy.numel(), 32768, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        out[i] = static_cast<T>(relu_scale_grad<C>(static_cast<C>(g[i]), static_cast<C>(rp[i]), a));
    });
  });
  return dx;
}

// ---------------------------------------------------------------------------------------------
// Autograd (C++, a FusedNode): saves the result; backward calls relu_scale_backward.

at::Tensor call_forward(const at::Tensor& input, double alpha) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, double)>("fastlayers::relu_scale");
  return op.call(input, alpha);
}

at::Tensor call_backward(const at::Tensor& grad_out, const at::Tensor& result, double alpha) {
  using BackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);
  static const auto op = find_op<BackwardSig>("fastlayers::relu_scale_backward");
  return op.call(grad_out, result, alpha);
}

// Backward of relu_scale: saves the result (or relu(x), see below); calls relu_scale_backward.
class ReluScaleBackward : public FusedNode {
 public:
  SavedVariable saved_tensor;
  double alpha = 1.0;
  bool saved_relu = false;  // saved_tensor is relu(x), not the result

  std::string name() const override { return "fastlayers::ReluScaleBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "torch.relu(x) * alpha");
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor saved_value = unpack(saved_tensor);
    if (saved_relu) {
      // native's backward of relu(x) * alpha: (grad * alpha) where relu(x) > 0 or NaN, else 0
      return {at::threshold_backward(grads[0].mul(alpha), saved_value, 0)};
    }
    return {call_backward(grads[0], saved_value, alpha)};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&saved_tensor}; }
};

at::Tensor relu_scale_autograd(const at::Tensor& input, double alpha) {
  if (!records_grad(input)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_forward(input, alpha);
  }
  NodePtr node_ptr = make_node<ReluScaleBackward>();
  auto* node = static_cast<ReluScaleBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  at::AutoDispatchBelowADInplaceOrView guard;
  at::Tensor y = call_forward(input, alpha);
  // An alpha that is infinite or NaN in the compute type (float32; float64 for float64
  // inputs) makes y NaN wherever x <= 0 (0 * inf, as native's): y then no longer tells where
  // x > 0, so relu(x) is kept instead (such an alpha is rare; every finite one keeps only y).
  const bool finite_alpha = input.scalar_type() == at::kDouble
                                ? std::isfinite(alpha)
                                : std::isfinite(static_cast<float>(alpha));
  torch::autograd::set_history(y, node_ptr);
  node->alpha = alpha;
  node->saved_relu = !finite_alpha;
  node->saved_tensor = finite_alpha ? SavedVariable(y, true)
                                    : SavedVariable(call_forward(input, 1.0), false);
  return y;
}

// The in-place op is for tensors autograd does not track; fastlayers.functional.relu_scale
// routes tracked ones through the out-of-place op and copy_ (autograd's in-place rules apply).
void relu_scale_inplace_autograd(const at::Tensor& input, double alpha) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && input.requires_grad()), kOp,
              "_: input requires grad; use fastlayers.functional.relu_scale(input, alpha, "
              "inplace=True), which keeps autograd's in-place semantics");
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto op = find_op<void(const at::Tensor&, double)>("fastlayers::relu_scale_");
  op.call(input, alpha);
  // Autograd must see the mutation: a graph that saved this tensor now errors in backward
  // instead of computing with the overwritten values.
  input.unsafeGetTensorImpl()->bump_version();
}

at::Tensor relu_scale_backward_autograd(const at::Tensor& grad_out, const at::Tensor& result,
                                        double alpha) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return call_backward(grad_out, result, alpha);
}

}  // namespace

at::Tensor relu_scale_eager(const at::Tensor& input, double alpha) {
  return call_forward(input, alpha);
}

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def("relu_scale(Tensor input, float alpha) -> Tensor");
  m.def("relu_scale_(Tensor(a!) input, float alpha) -> ()");
  m.def("relu_scale_backward(Tensor grad_out, Tensor result, float alpha) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("relu_scale", &relu_scale_cpu);
  m.impl("relu_scale_", &relu_scale_inplace_cpu);
  m.impl("relu_scale_backward", &relu_scale_backward_cpu);
}

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("relu_scale", &relu_scale_autograd);
  m.impl("relu_scale_", &relu_scale_inplace_autograd);
  m.impl("relu_scale_backward", &relu_scale_backward_autograd);
}

}  // namespace fastlayers
