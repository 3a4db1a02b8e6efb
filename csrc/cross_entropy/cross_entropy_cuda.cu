// CUDA side of cross_entropy_rows_ (cross_entropy.cpp says what it computes): one block per
// row; pass one an online max / sum of exponentials over the row (16-byte loads where the row
// allows), pass two (with grad) the gradient written over the row, the row read again (mostly
// from L2). Bytes: the row read twice and written once, in its own dtype.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "cross_entropy/cross_entropy.h"

namespace fastlayers {

namespace {
constexpr int kThreads = 512;

// the running max and the sum of exp(z - max): the sum in float64 (n terms summed in float32
// lose about log2(n) bits; the terms themselves are float32 expf)
struct MaxSum {
  float m;
  double s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0};
  return {m, a.s * static_cast<double>(expf(a.m - m)) + b.s * static_cast<double>(expf(b.m - m))};
}

__device__ __forceinline__ void add(MaxSum& acc, float z) {
  if (z > acc.m) {
    acc.s = acc.s * static_cast<double>(expf(acc.m - z)) + 1.0;
    acc.m = z;
  } else {
    acc.s += static_cast<double>(expf(z - acc.m));
  }
}

// the block's (max, sum), the same on every thread
__device__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum warps[kThreads / 32];
  __shared__ MaxSum total;
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum o{__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)};
    v = merge(v, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warps[lane] : MaxSum{-INFINITY, 0.0};
    for (int offset = 16; offset > 0; offset /= 2) {
      MaxSum o{__shfl_xor_sync(0xffffffffu, v.m, offset),
               __shfl_xor_sync(0xffffffffu, v.s, offset)};
      v = merge(v, o);
    }
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// VEC elements per 16-byte access (1: scalar accesses, for rows that are not aligned)
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(T* __restrict__ logits, const int64_t* __restrict__ target,
                              const float* __restrict__ normaliser, float* __restrict__ loss,
                              int64_t vocab, float cap, bool grad) {
  using M = CrossEntropyMath<T>;
  T* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  const int64_t t = target[blockIdx.x];
  MaxSum acc{-INFINITY, 0.0};
  float capped = 0.0f;
  const int64_t step = static_cast<int64_t>(kThreads) * VEC;
  const int64_t whole = vocab / step * step;  // columns in whole steps; the rest one by one
  for (int64_t j = threadIdx.x * VEC; j < whole; j += step) {
    if constexpr (VEC > 1) {
      uint4 raw = *reinterpret_cast<const uint4*>(row + j);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < VEC; ++k) add(acc, M::logit(e[k], cap, &capped));
    } else {
      add(acc, M::logit(row[j], cap, &capped));
    }
  }
  for (int64_t j = whole + threadIdx.x; j < vocab; j += kThreads)
    add(acc, M::logit(row[j], cap, &capped));
  const MaxSum all = block_merge(acc);
  const float log_sum = static_cast<float>(log(all.s));
  if (threadIdx.x == 0) loss[blockIdx.x] = log_sum - (M::logit(row[t], cap, &capped) - all.m);
  if (!grad) return;
  __syncthreads();  // row[t] read before any thread overwrites it
  const float norm = *normaliser;
  for (int64_t j = threadIdx.x * VEC; j < whole; j += step) {
    if constexpr (VEC > 1) {
      uint4 raw = *reinterpret_cast<const uint4*>(row + j);
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float z = M::logit(e[k], cap, &capped);
        e[k] = M::grad(z, all.m, log_sum, j + k == t, norm, cap, capped);
      }
      *reinterpret_cast<uint4*>(row + j) = raw;
    } else {
      const float z = M::logit(row[j], cap, &capped);
      row[j] = M::grad(z, all.m, log_sum, j == t, norm, cap, capped);
    }
  }
  for (int64_t j = whole + threadIdx.x; j < vocab; j += kThreads) {
    const float z = M::logit(row[j], cap, &capped);
    row[j] = M::grad(z, all.m, log_sum, j == t, norm, cap, capped);
  }
}
}  // namespace

at::Tensor cross_entropy_rows_cuda(at::Tensor& logits, const at::Tensor& target,
                                   const at::Tensor& normaliser, double softcap, bool grad) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "fastlayers.cross_entropy_rows_: logits must be a contiguous [rows, vocabulary] "
              "tensor");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0) &&
                  target.scalar_type() == at::kLong && target.device() == logits.device(),
              "fastlayers.cross_entropy_rows_: target must be int64 [rows] on logits' device");
  TORCH_CHECK(normaliser.numel() == 1 && normaliser.scalar_type() == at::kFloat &&
                  normaliser.device() == logits.device(),
              "fastlayers.cross_entropy_rows_: normaliser must be a float32 scalar tensor on "
              "logits' device");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor loss = at::empty({rows}, logits.options().dtype(at::kFloat));
  if (rows == 0) return loss;
  TORCH_CHECK(rows <= std::numeric_limits<int>::max(),
              "fastlayers.cross_entropy_rows_: too many rows for one launch");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float cap = static_cast<float>(softcap);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, logits.scalar_type(), "cross_entropy_rows_", [&] {
        constexpr int kVec = 16 / sizeof(scalar_t);
        scalar_t* x = logits.data_ptr<scalar_t>();
        const bool vec = vocab % kVec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
        auto* kernel = vec ? cross_entropy_rows_kernel<scalar_t, kVec>
                           : cross_entropy_rows_kernel<scalar_t, 1>;
        kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
            x, target.data_ptr<int64_t>(), normaliser.data_ptr<float>(), loss.data_ptr<float>(),
            vocab, cap, grad);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return loss;
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) { m.impl("cross_entropy_rows_", &cross_entropy_rows_cuda); }

}  // namespace fastlayers
