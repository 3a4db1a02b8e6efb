// ReLUScale CUDA kernels: elementwise over 16-byte vectors, several vectors in flight per
// thread, one contiguous chunk per block; a scalar path for unaligned buffers and the tail.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "common.h"
#include "cuda_utils.cuh"
#include "relu_scale.h"

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.relu_scale";
constexpr int kThreads = 256;
// Vectors in flight per thread: the forward streams one input, the backward two.
template <bool kBackward>
constexpr int unroll_of() {
  return kBackward ? 4 : 8;
}

using cuda::vec_of;

// out[i] = f(a[i], b[i]) for i < n; b may be null (forward). out may alias a (in place).
// Block k handles one contiguous chunk of kThreads * kUnroll vectors (consecutive blocks walk
// memory in order); the vectors past the last whole one are done element by element.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    relu_scale_kernel(const T* a, const T* b, T* out, int64_t n, float alpha, bool vectorized) {
  constexpr int VEC = vec_of<T>();
  constexpr int kUnroll = unroll_of<kBackward>();
  auto apply = [alpha](float va, float vb) {
    return kBackward ? relu_scale_grad(va, vb, alpha) : relu_scale_value(va, alpha);
  };
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll;
  if (!vectorized) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = chunk + u * kThreads + threadIdx.x;
      if (i < n) {
        const float vb = kBackward ? static_cast<float>(b[i]) : 0.f;
        out[i] = static_cast<T>(apply(static_cast<float>(a[i]), vb));
      }
    }
    return;
  }
  const int64_t nvec = n / VEC;
  cuda::RawVec<T, VEC> ra[kUnroll], rb[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = chunk + u * kThreads + threadIdx.x;
    if (v < nvec) {
      ra[u] = cuda::load_raw<T, VEC>(a + v * VEC);
      if (kBackward) rb[u] = cuda::load_raw<T, VEC>(b + v * VEC);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = chunk + u * kThreads + threadIdx.x;
    if (v < nvec) {
      float fa[VEC], fb[VEC], o[VEC];
      cuda::unpack_floats<T, VEC>(ra[u], fa);
      if (kBackward) cuda::unpack_floats<T, VEC>(rb[u], fb);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = apply(fa[k], kBackward ? fb[k] : 0.f);
      cuda::store_floats<T, VEC>(out + v * VEC, o);
    }
  }
  const int64_t i = nvec * VEC + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) {
    const float vb = kBackward ? static_cast<float>(b[i]) : 0.f;
    out[i] = static_cast<T>(apply(static_cast<float>(a[i]), vb));
  }
}

template <bool kBackward>
void launch(const at::Tensor& a, const at::Tensor* b, const at::Tensor& out, double alpha) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(out.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pa = a.data_ptr<T>();
    const T* pb = b ? b->data_ptr<T>() : nullptr;
    T* po = out.data_ptr<T>();
    const bool vectorized = cuda::aligned16(pa) && cuda::aligned16(po) && cuda::aligned16(pb);
    constexpr int64_t kPerBlock = int64_t{kThreads} * unroll_of<kBackward>();
    // Vectorized: one block per chunk of vectors, and at least one for the (< VEC) tail.
    const int64_t units = vectorized ? n / vec_of<T>() : n;
    const int64_t blocks = std::max<int64_t>(1, (units + kPerBlock - 1) / kPerBlock);
    TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), kOp, ": input too large");
    relu_scale_kernel<T, kBackward><<<blocks, kThreads, 0, stream>>>(
        pa, pb, po, n, static_cast<float>(alpha), vectorized);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

at::Tensor relu_scale_cuda(const at::Tensor& input, double alpha) {
  check_relu_scale_input(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  launch<false>(x, nullptr, y, alpha);
  return y;
}

void relu_scale_inplace_cuda(const at::Tensor& input, double alpha) {
  check_relu_scale_input(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
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
