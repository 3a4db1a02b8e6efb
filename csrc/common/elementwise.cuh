// One elementwise CUDA kernel for every op family: out[i] = f(a[i], b[i]) over 16-byte vectors,
// several vectors in flight per thread, one contiguous chunk per block; a scalar path for
// unaligned buffers and the tail. f takes and returns at::opmath_type<T> (the math runs in float,
// in double for float64); a functor declares `static constexpr bool kBinary` (whether it reads a
// second tensor b).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "common/cuda_utils.cuh"

namespace fastlayers {
namespace cuda {

constexpr int kElementwiseThreads = 256;

// out may alias a (in place); b is null for unary functions (kBinary false). Block k handles one
// contiguous chunk of kThreads * kUnroll vectors (consecutive blocks walk memory in order); the
// elements past the last whole vector are done one by one.
template <typename T, bool kBinary, int kUnroll, typename F>
__global__ void __launch_bounds__(kElementwiseThreads)
    elementwise_kernel(const T* a, const T* b, T* out, int64_t n, F f, bool vectorized) {
  using A = at::opmath_type<T>;
  constexpr int VEC = vec_of<T>();
  constexpr int kThreads = kElementwiseThreads;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll;
  if (!vectorized) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = chunk + u * kThreads + threadIdx.x;
      if (i < n) {
        const A vb = kBinary ? static_cast<A>(b[i]) : A(0);
        out[i] = static_cast<T>(f(static_cast<A>(a[i]), vb));
      }
    }
    return;
  }
  const int64_t nvec = n / VEC;
  RawVec<T, VEC> ra[kUnroll], rb[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = chunk + u * kThreads + threadIdx.x;
    if (v < nvec) {
      ra[u] = load_raw<T, VEC>(a + v * VEC);
      if (kBinary) rb[u] = load_raw<T, VEC>(b + v * VEC);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = chunk + u * kThreads + threadIdx.x;
    if (v < nvec) {
      A fa[VEC], fb[VEC], o[VEC];
      unpack_floats<T, VEC>(ra[u], fa);
      if (kBinary) unpack_floats<T, VEC>(rb[u], fb);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = f(fa[k], kBinary ? fb[k] : A(0));
      store_floats<T, VEC>(out + v * VEC, o);
    }
  }
  const int64_t i = nvec * VEC + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) {
    const A vb = kBinary ? static_cast<A>(b[i]) : A(0);
    out[i] = static_cast<T>(f(static_cast<A>(a[i]), vb));
  }
}

// Launches elementwise_kernel over n elements on the current stream (b null for unary F).
// kUnroll vectors per thread suit large tensors; when that grid would leave SMs idle (fewer than
// two blocks per SM), one vector per thread spreads the work over 8x more blocks instead.
template <int kUnroll, typename T, typename F>
void launch_elementwise(const T* a, const T* b, T* out, int64_t n, F f, const char* op) {
  if (n == 0) return;
  const bool vectorized = aligned16(a) && aligned16(b) && aligned16(out);
  // Vectorized: one block per chunk of vectors, and at least one for the (< VEC) tail.
  const int64_t units = vectorized ? n / vec_of<T>() : n;
  const auto blocks_for = [&](int64_t unroll) {
    const int64_t per_block = int64_t{kElementwiseThreads} * unroll;
    return std::max<int64_t>(1, (units + per_block - 1) / per_block);
  };
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const bool small = kUnroll > 1 && blocks_for(kUnroll) < 2 * sms;
  const int64_t blocks = blocks_for(small ? 1 : kUnroll);
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": input too large");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (small) {
    elementwise_kernel<T, F::kBinary, 1, F>
        <<<blocks, kElementwiseThreads, 0, stream>>>(a, b, out, n, f, vectorized);
  } else {
    elementwise_kernel<T, F::kBinary, kUnroll, F>
        <<<blocks, kElementwiseThreads, 0, stream>>>(a, b, out, n, f, vectorized);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace fastlayers
