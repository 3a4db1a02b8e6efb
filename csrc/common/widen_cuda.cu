// widen_to_float (widen.h): 8-byte loads of four 16-bit values, 16-byte stores of their float32
// values, several loads in flight per thread; one element at a time where the source is not
// 8-byte aligned. Here, not in shared_cast.cpp: the C++ compiler of a build may not see the CUDA
// runtime's headers (setup.py), which ATen's CUDA context needs.
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

}  // namespace

std::optional<at::Tensor> widen_to_float(const at::Tensor& g) {
  if (at::isTensorSubclassLike(g) || g._is_zerotensor() || g.is_neg() || !g.has_storage())
    return std::nullopt;
  const at::ScalarType from = g.scalar_type();
  if (!g.is_cuda() || (from != at::kBFloat16 && from != at::kHalf) || !g.is_contiguous())
    return std::nullopt;
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor out = at::empty(g.sizes(), g.options().dtype(at::kFloat));
  const int64_t n = g.numel();
  if (n == 0) return out;
  // at most 8 resident blocks of 256 threads an SM (2,048 threads: the SM's limit)
  const int max_blocks =
      at::cuda::getCurrentDeviceProperties()->multiProcessorCount * (2048 / kWidenThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (from == at::kBFloat16) {
    launch(g.const_data_ptr<c10::BFloat16>(), out.data_ptr<float>(), n, max_blocks, stream);
  } else {
    launch(g.const_data_ptr<c10::Half>(), out.data_ptr<float>(), n, max_blocks, stream);
  }
  return out;
}

}  // namespace fastlayers
