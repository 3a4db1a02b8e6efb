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

// Four 16-bit values (8 bytes) as their four floats.
template <typename S>
__device__ __forceinline__ float4 widen4(uint2 w) {
  const S* e = reinterpret_cast<const S*>(&w);
  return make_float4(static_cast<float>(e[0]), static_cast<float>(e[1]), static_cast<float>(e[2]),
                     static_cast<float>(e[3]));
}

__device__ __forceinline__ float4 plus(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// dst[i] = float(src[i]) (widen_to_float), or with ACCUMULATE dst[i] + float(src[i])
// (add_widened: the engine's addition of a widened gradient to the sum it holds; ATen's add
// computes a + 1 * b in float, the same rounding). Four 16-bit values (8 bytes) in, their four
// floats (one 16-byte store) out: a warp's loads and stores are both whole contiguous spans (two
// 16-byte stores from one 16-byte load wrote half-sector strides: 2.4 TB/s on an H200).
// Grid-stride over a persistent grid, so that every block has the same share and no partial last
// wave is left.
template <typename S, bool ACCUMULATE>
__device__ __forceinline__ void widen_all(float* __restrict__ dst, const S* __restrict__ src,
                                          int64_t n, bool vectorized) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWidenThreads;
  int64_t u = static_cast<int64_t>(blockIdx.x) * kWidenThreads + threadIdx.x;
  auto element = [&](int64_t i) {
    const float v = static_cast<float>(src[i]);
    dst[i] = ACCUMULATE ? dst[i] + v : v;
  };
  if (!vectorized) {
    for (; u < n; u += stride) element(u);
    return;
  }
  const int64_t units = n / 4;
  const uint2* s4 = reinterpret_cast<const uint2*>(src);
  float4* d4 = reinterpret_cast<float4*>(dst);
  for (; u + (kWidenUnroll - 1) * stride < units; u += kWidenUnroll * stride) {
    uint2 w[kWidenUnroll];
    float4 a[kWidenUnroll] = {};  // the sums so far (ACCUMULATE)
#pragma unroll
    for (int k = 0; k < kWidenUnroll; ++k) {
      w[k] = s4[u + k * stride];
      if constexpr (ACCUMULATE) a[k] = d4[u + k * stride];
    }
#pragma unroll
    for (int k = 0; k < kWidenUnroll; ++k) {
      const float4 v = widen4<S>(w[k]);
      d4[u + k * stride] = ACCUMULATE ? plus(a[k], v) : v;
    }
  }
  for (; u < units; u += stride) {
    const float4 v = widen4<S>(s4[u]);
    d4[u] = ACCUMULATE ? plus(d4[u], v) : v;
  }
  // the last n % 4 elements: block 0's first threads
  const int64_t i = units * 4 + threadIdx.x;
  if (blockIdx.x == 0 && i < n) element(i);
}

// Two kernels of one body, so that a profile names which ran.
template <typename S>
__global__ void __launch_bounds__(kWidenThreads)
    widen_kernel(float* __restrict__ dst, const S* __restrict__ src, int64_t n, bool vectorized) {
  widen_all<S, false>(dst, src, n, vectorized);
}

template <typename S>
__global__ void __launch_bounds__(kWidenThreads)
    add_widened_kernel(float* __restrict__ dst, const S* __restrict__ src, int64_t n,
                       bool vectorized) {
  widen_all<S, true>(dst, src, n, vectorized);
}

// at most 8 resident blocks of 256 threads an SM (2,048 threads: the SM's limit)
int max_blocks() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount * (2048 / kWidenThreads);
}

// The kernel over n values of src into dst, on the current device's current stream.
template <bool ACCUMULATE, typename S>
void launch(float* dst, const S* src, int64_t n) {
  if (n == 0) return;
  const bool vectorized = reinterpret_cast<uintptr_t>(src) % 8 == 0 && cuda::aligned16(dst);
  const int64_t units = vectorized ? n / 4 : n;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(max_blocks(), (units + kWidenThreads - 1) / kWidenThreads));
  auto* kernel = ACCUMULATE ? add_widened_kernel<S> : widen_kernel<S>;
  kernel<<<static_cast<unsigned>(blocks), kWidenThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      dst, src, n, vectorized);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool ACCUMULATE>
void launch(float* dst, const at::Tensor& g) {
  if (g.scalar_type() == at::kBFloat16) {
    launch<ACCUMULATE>(dst, g.const_data_ptr<c10::BFloat16>(), g.numel());
  } else {
    launch<ACCUMULATE>(dst, g.const_data_ptr<c10::Half>(), g.numel());
  }
}

// Whether the kernels may read g: a plain contiguous 16-bit CUDA tensor holding its values in
// its storage (widen.h lists what takes ATen's conversion instead).
bool widenable(const at::Tensor& g) {
  if (at::isTensorSubclassLike(g) || g._is_zerotensor() || g.is_neg() || !g.has_storage())
    return false;
  const at::ScalarType from = g.scalar_type();
  return g.is_cuda() && (from == at::kBFloat16 || from == at::kHalf) && g.is_contiguous();
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
  launch</*ACCUMULATE=*/true>(sum.data_ptr<float>(), g);
  return true;
}

std::optional<at::Tensor> widen_to_float(const at::Tensor& g) {
  if (!widenable(g)) return std::nullopt;
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor out = at::empty(g.sizes(), g.options().dtype(at::kFloat));
  launch</*ACCUMULATE=*/false>(out.data_ptr<float>(), g);
  return out;
}

}  // namespace fastlayers
