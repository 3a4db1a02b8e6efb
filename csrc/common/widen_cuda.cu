// widen_to_float, add_widened, widening_stream (widen.h): 8-byte loads of four 16-bit values,
// 16-byte stores of their float32 values, several loads in flight per thread; one element at a
// time where the source is not 8-byte aligned. Here, not in shared_cast.cpp: the C++ compiler
// of a build may not see the CUDA runtime's headers (setup.py), which ATen's CUDA context needs.
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/widen.h"

namespace fastlayers {

namespace {

constexpr int kWidenThreads = 256;
constexpr int kWidenUnroll = 4;  // source loads a thread keeps in flight

// Four 16-bit values (8 bytes) in, their four floats (one 16-byte store) out: a warp's loads
// and stores are both whole contiguous spans (two 16-byte stores from one 16-byte load wrote
// half-sector strides: 2.4 TB/s on an H200). Grid-stride over a persistent grid, so that every
// block has the same share and no partial last wave is left.
template <typename S>
__global__ void __launch_bounds__(kWidenThreads)
    widen_kernel(const S* __restrict__ src, float* __restrict__ dst, int64_t n, bool vectorized) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWidenThreads;
  int64_t u = static_cast<int64_t>(blockIdx.x) * kWidenThreads + threadIdx.x;
  if (!vectorized) {
    for (; u < n; u += stride) dst[u] = static_cast<float>(src[u]);
    return;
  }
  const int64_t units = n / 4;
  const uint2* s4 = reinterpret_cast<const uint2*>(src);
  float4* d4 = reinterpret_cast<float4*>(dst);
  auto widen4 = [](uint2 w) {
    const S* e = reinterpret_cast<const S*>(&w);
    return make_float4(static_cast<float>(e[0]), static_cast<float>(e[1]),
                       static_cast<float>(e[2]), static_cast<float>(e[3]));
  };
  for (; u + (kWidenUnroll - 1) * stride < units; u += kWidenUnroll * stride) {
    uint2 w[kWidenUnroll];
#pragma unroll
    for (int k = 0; k < kWidenUnroll; ++k) w[k] = s4[u + k * stride];
#pragma unroll
    for (int k = 0; k < kWidenUnroll; ++k) d4[u + k * stride] = widen4(w[k]);
  }
  for (; u < units; u += stride) d4[u] = widen4(s4[u]);
  // the last n % 4 elements: block 0's first threads
  const int64_t i = units * 4 + threadIdx.x;
  if (blockIdx.x == 0 && i < n) dst[i] = static_cast<float>(src[i]);
}

template <typename S>
void launch(const S* src, float* dst, int64_t n, int max_blocks, cudaStream_t stream) {
  const bool vectorized =
      reinterpret_cast<uintptr_t>(src) % 8 == 0 && cuda::aligned16(dst);
  const int64_t units = vectorized ? n / 4 : n;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(max_blocks, (units + kWidenThreads - 1) / kWidenThreads));
  widen_kernel<S><<<static_cast<unsigned>(blocks), kWidenThreads, 0, stream>>>(src, dst, n,
                                                                                 vectorized);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// acc[i] + float(src[i]) into acc[i]: the engine's addition of a widened gradient to the sum it
// holds (ATen's add computes a + 1 * b in float: the same rounding), in one pass.
template <typename S>
__global__ void __launch_bounds__(kWidenThreads)
    add_widened_kernel(float* __restrict__ acc, const S* __restrict__ src, int64_t n,
                       bool vectorized) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWidenThreads;
  int64_t u = static_cast<int64_t>(blockIdx.x) * kWidenThreads + threadIdx.x;
  if (!vectorized) {
    for (; u < n; u += stride) acc[u] = acc[u] + static_cast<float>(src[u]);
    return;
  }
  const int64_t units = n / 4;
  const uint2* s4 = reinterpret_cast<const uint2*>(src);
  float4* a4 = reinterpret_cast<float4*>(acc);
  auto add4 = [](float4 a, uint2 w) {
    const S* e = reinterpret_cast<const S*>(&w);
    return make_float4(a.x + static_cast<float>(e[0]), a.y + static_cast<float>(e[1]),
                       a.z + static_cast<float>(e[2]), a.w + static_cast<float>(e[3]));
  };
  for (; u + (kWidenUnroll - 1) * stride < units; u += kWidenUnroll * stride) {
    uint2 w[kWidenUnroll];
    float4 a[kWidenUnroll];
#pragma unroll
    for (int k = 0; k < kWidenUnroll; ++k) {
      w[k] = s4[u + k * stride];
      a[k] = a4[u + k * stride];
    }
#pragma unroll
    for (int k = 0; k < kWidenUnroll; ++k) a4[u + k * stride] = add4(a[k], w[k]);
  }
  for (; u < units; u += stride) a4[u] = add4(a4[u], s4[u]);
  const int64_t i = units * 4 + threadIdx.x;
  if (blockIdx.x == 0 && i < n) acc[i] = acc[i] + static_cast<float>(src[i]);
}

template <typename S>
void launch_add(float* acc, const S* src, int64_t n, int max_blocks, cudaStream_t stream) {
  const bool vectorized = reinterpret_cast<uintptr_t>(src) % 8 == 0 && cuda::aligned16(acc);
  const int64_t units = vectorized ? n / 4 : n;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(max_blocks, (units + kWidenThreads - 1) / kWidenThreads));
  add_widened_kernel<S><<<static_cast<unsigned>(blocks), kWidenThreads, 0, stream>>>(
      acc, src, n, vectorized);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether widen_kernel may read g: a plain contiguous 16-bit CUDA tensor holding its values in
// its storage (widen.h lists what takes ATen's conversion instead).
bool widenable(const at::Tensor& g) {
  if (at::isTensorSubclassLike(g) || g._is_zerotensor() || g.is_neg() || !g.has_storage())
    return false;
  const at::ScalarType from = g.scalar_type();
  return g.is_cuda() && (from == at::kBFloat16 || from == at::kHalf) && g.is_contiguous();
}

// at most 8 resident blocks of 256 threads an SM (2,048 threads: the SM's limit)
int max_blocks() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount * (2048 / kWidenThreads);
}

}  // namespace

std::optional<c10::Stream> widening_stream(const at::Tensor& g) {
  if (!widenable(g)) return std::nullopt;
  const c10::cuda::CUDAGuard guard(g.device());
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  if (status != cudaStreamCaptureStatusNone) return std::nullopt;
  return c10::Stream(stream);
}

bool add_widened(const at::Tensor& sum, const at::Tensor& g) {
  if (!widenable(g) || !sum.is_contiguous() || sum.scalar_type() != at::kFloat ||
      sum.device() != g.device() || sum.sizes() != g.sizes() || at::isTensorSubclassLike(sum))
    return false;
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t n = g.numel();
  if (n == 0) return true;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (g.scalar_type() == at::kBFloat16) {
    launch_add(sum.data_ptr<float>(), g.const_data_ptr<c10::BFloat16>(), n, max_blocks(), stream);
  } else {
    launch_add(sum.data_ptr<float>(), g.const_data_ptr<c10::Half>(), n, max_blocks(), stream);
  }
  return true;
}

std::optional<at::Tensor> widen_to_float(const at::Tensor& g) {
  if (!widenable(g)) return std::nullopt;
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor out = at::empty(g.sizes(), g.options().dtype(at::kFloat));
  const int64_t n = g.numel();
  if (n == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (g.scalar_type() == at::kBFloat16) {
    launch(g.const_data_ptr<c10::BFloat16>(), out.data_ptr<float>(), n, max_blocks(), stream);
  } else {
    launch(g.const_data_ptr<c10::Half>(), out.data_ptr<float>(), n, max_blocks(), stream);
  }
  return out;
}

}  // namespace fastlayers
