// ReLUScale CUDA kernels: the shared elementwise kernel (elementwise.cuh) with the ReLUScale
// rules of relu_scale.h.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/arch_check.h"
#include "common/common.h"
#include "common/elementwise.cuh"
#include "relu_scale/relu_scale.h"

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.relu_scale";

// C: the arithmetic type, at::opmath_type of the data (float; double for float64).
template <typename C>
struct ReluScaleForward {
  static constexpr bool kBinary = false;
  C alpha;
  __device__ C operator()(C x, C) const { return relu_scale_value<C>(x, alpha); }
};

template <typename C>
struct ReluScaleBackward {
  static constexpr bool kBinary = true;
  C alpha;
  __device__ C operator()(C dy, C r) const { return relu_scale_grad<C>(dy, r, alpha); }
};

// Vectors in flight per thread: the forward streams one input, the backward two.
template <bool kBackward>
void launch(const at::Tensor& a, const at::Tensor* b, const at::Tensor& out, double alpha) {
  dispatch_dtype_f64(out.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = at::opmath_type<T>;
    const C ca = static_cast<C>(alpha);
    if constexpr (kBackward) {
      cuda::launch_elementwise<4>(a.data_ptr<T>(), b->data_ptr<T>(), out.data_ptr<T>(),
                                  out.numel(), ReluScaleBackward<C>{ca}, kOp);
    } else {
      cuda::launch_elementwise<8>(a.data_ptr<T>(), static_cast<const T*>(nullptr),
                                  out.data_ptr<T>(), out.numel(), ReluScaleForward<C>{ca}, kOp);
    }
  });
}

}  // namespace

at::Tensor relu_scale_cuda(const at::Tensor& input, double alpha) {
  check_relu_scale_input(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  launch<false>(x, nullptr, y, alpha);
  return y;
}

void relu_scale_inplace_cuda(const at::Tensor& input, double alpha) {
  check_relu_scale_input(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  if (!input.is_contiguous()) {
    input.copy_(relu_scale_cuda(input, alpha));
    return;
  }
  launch<false>(input, nullptr, input, alpha);
}

at::Tensor relu_scale_backward_cuda(const at::Tensor& grad_out, const at::Tensor& result,
                                    double alpha) {
  check_relu_scale_backward_args(grad_out, result);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  check_kernel_image(grad_out.get_device(), kOp);
  const at::Tensor dy = grad_out.contiguous(), r = result.contiguous();
  at::Tensor dx = at::empty(dy.sizes(), dy.options());
  launch<true>(dy, &r, dx, alpha);
  return dx;
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("relu_scale", &relu_scale_cuda);
  m.impl("relu_scale_", &relu_scale_inplace_cuda);
  m.impl("relu_scale_backward", &relu_scale_backward_cuda);
}

}  // namespace fastlayers
