// LayerNorm CUDA kernels: the row kernels of layer_norm_kernels.cuh (fast register-resident path,
// generic path, deterministic dweight/dbias partial sums; described there) run with LayerNorm's
// own row policies (PlainRows: read x; PlainSink: write dx). This file defines the host helpers
// those launchers share with dropout_add_layer_norm_cuda.cu, and the op's entry points.
//
// float64 inputs take simple double-precision kernels instead (layer_norm_cuda_f64.cu).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "common/arch_check.h"
#include "common/common.h"
#include "common/cuda_utils.cuh"
#include "layer_norm/layer_norm.h"
#include "layer_norm/layer_norm_kernels.cuh"

namespace fastlayers {
namespace ln {
namespace {

constexpr int kSumCols = 8;
constexpr int kSumSlices = 64;

__device__ __forceinline__ void store_as(void* out, int64_t i, float v, int dtype_code) {
  if (dtype_code == 0) {
    static_cast<float*>(out)[i] = v;
  } else if (dtype_code == 1) {
    static_cast<c10::Half*>(out)[i] = static_cast<c10::Half>(v);
  } else {
    static_cast<c10::BFloat16*>(out)[i] = static_cast<c10::BFloat16>(v);
  }
}

// Adds v to the compensated sum (s, c): s + c carries the running sum with the rounding error of
// every add kept in c (Knuth's two-sum), so a chain of n adds rounds about once, not n times.
__device__ __forceinline__ void two_sum_add(float& s, float& c, float v) {
  const float t = s + v;
  const float bp = t - s;
  c += (s - (t - bp)) + (v - bp);
  s = t;
}

// out_y[c] = sum over p of part[y, p, c] for y = blockIdx.y (dweight, dbias): each of 64 slices
// sums its rows in order, then the slice sums are added in order, all compensated: the
// partials are thousands of rows at large row counts, where plain chains cost the weight
// gradient 2-3x native's error (the DESIGN bound is 2x). Deterministic.
__global__ void sum_partials_kernel(const float* __restrict__ part, int64_t prows, int cols,
                                    void* out0, int code0, void* out1, int code1) {
  __shared__ float sums[kSumSlices][kSumCols + 1];
  __shared__ float comps[kSumSlices][kSumCols + 1];
  const float* p = part + blockIdx.y * prows * cols;
  const int col = blockIdx.x * kSumCols + threadIdx.x;
  float s = 0.f, c = 0.f;
  if (col < cols)
    for (int64_t r = threadIdx.y; r < prows; r += kSumSlices) two_sum_add(s, c, p[r * cols + col]);
  sums[threadIdx.y][threadIdx.x] = s;
  comps[threadIdx.y][threadIdx.x] = c;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = 0.f, e = 0.f;
    for (int k = 0; k < kSumSlices; ++k) {
      two_sum_add(t, e, sums[k][threadIdx.x]);
      e += comps[k][threadIdx.x];
    }
    store_as(blockIdx.y == 0 ? out0 : out1, col, t + e, blockIdx.y == 0 ? code0 : code1);
  }
}

int dtype_code(at::ScalarType st) {
  return st == at::kFloat ? 0 : (st == at::kHalf ? 1 : 2);
}

}  // namespace

std::optional<VecConfig> pick_config(int64_t cols, int vec, int max_elems, int max_tpr,
                                     const char* env_tpr, int items4_max_tpr, bool fwd) {
  if (cols % vec != 0) return std::nullopt;
  const int64_t nvec = cols / vec;
  const int imax = items_max(vec, max_elems);
  auto items_for = [&](int tpr) {
    const int64_t items = (nvec + tpr - 1) / tpr;
    return items <= 1 ? 1 : (items <= 2 ? 2 : (items <= 4 ? 4 : 8));
  };
  auto fits = [&](int tpr, int items_cap) {
    return nvec <= static_cast<int64_t>(tpr) * std::min(imax, items_cap) &&
           has_vec_kernel(tpr, items_for(tpr), fwd);
  };
  if (const char* forced = std::getenv(env_tpr)) {
    const int tpr = std::atoi(forced);
    if ((tpr == 32 || tpr == 64 || tpr == 128 || tpr == 256 || tpr == 512 || tpr == 1024) &&
        tpr <= max_tpr && fits(tpr, imax))
      return VecConfig{tpr, items_for(tpr)};
  }
  for (int tpr = 32; tpr <= std::min(max_tpr, items4_max_tpr); tpr *= 2) {
    if (fits(tpr, 4)) return VecConfig{tpr, items_for(tpr)};
  }
  for (int tpr = 32; tpr <= max_tpr; tpr *= 2) {
    if (fits(tpr, imax)) return VecConfig{tpr, items_for(tpr)};
  }
  return std::nullopt;
}

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

int blocks_per_sm(const void* kernel, int threads, int smem, const char* op) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  const std::tuple<const void*, int, int> key{kernel, at::cuda::current_device(), smem};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int smem_limit = static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
  TORCH_CHECK(smem <= smem_limit, op, ": row too wide for shared memory (",
              std::to_string(smem), " > ", std::to_string(smem_limit), " bytes)");
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  n = std::max(n, 1);
  cache.emplace(key, n);
  return n;
}

void sum_partials(const at::Tensor& part, const std::vector<at::Tensor>& outs,
                  cudaStream_t stream) {
  const int cols = static_cast<int>(part.size(2));
  const at::Tensor& second = outs.size() > 1 ? outs[1] : outs[0];
  const dim3 grid((cols + kSumCols - 1) / kSumCols, static_cast<unsigned>(outs.size()));
  sum_partials_kernel<<<grid, dim3(kSumCols, kSumSlices), 0, stream>>>(
      part.data_ptr<float>(), part.size(1), cols, outs[0].data_ptr(),
      dtype_code(outs[0].scalar_type()), second.data_ptr(), dtype_code(second.scalar_type()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ln

namespace {

constexpr const char* kOp = "fastlayers.layer_norm";

using cuda::aligned16;

}  // namespace

LayerNormOutputs layer_norm_fwd_cuda(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias, double eps,
                                     std::optional<at::ScalarType> out_dtype) {
  const RowsCols rc = check_layer_norm_args(input, normalized_shape, weight, bias, out_dtype);
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const at::Tensor x = input.contiguous();
  const std::optional<at::Tensor> w =
      weight.has_value() && weight->defined() ? std::optional(weight->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> b =
      bias.has_value() && bias->defined() ? std::optional(bias->contiguous()) : std::nullopt;
  at::Tensor y, mean, rstd;  // not a structured binding: C++17 lambdas cannot capture one
  std::tie(y, mean, rstd) = empty_forward_outputs(input, normalized_shape, out_dtype);
  if (rc.rows == 0) return {y, mean, rstd};
  if (x.scalar_type() == at::kDouble) {  // the simple float64 kernels, not the tuned ones below
    layer_norm_fwd_cuda_f64(x, w.value_or(at::Tensor()), b.value_or(at::Tensor()), eps, y, mean,
                            rstd, rc.rows, rc.cols);
    return {y, mean, rstd};
  }

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int cols = static_cast<int>(rc.cols);
  const int wk = ln::param_kind(w, x.scalar_type()), bk = ln::param_kind(b, x.scalar_type());
  const void* wp = ln::param_ptr(w);
  const void* bp = ln::param_ptr(b);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(wp) &&
                       aligned16(bp);
  dispatch_dtype(x.scalar_type(), kOp, [&](auto in_tag) {
    using T = typename decltype(in_tag)::type;
    dispatch_dtype(y.scalar_type(), kOp, [&](auto out_tag) {
      using O = typename decltype(out_tag)::type;
      if constexpr (std::is_same_v<O, T> || std::is_same_v<O, float>) {
        using Src = ln::PlainRows<T>;
        ln::launch_fwd<O>(Src{x.data_ptr<T>()},
                          ln::fwd_vec_config<Src>(cols, aligned, "FASTLAYERS_LN_FWD_TPR"), wp, bp,
                          wk, bk, y.data_ptr<O>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                          rc.rows, cols, static_cast<float>(eps), kOp, stream);
      } else {
        TORCH_CHECK(false, kOp, ": out_dtype must be the input's dtype or float32");
      }
    });
  });
  return {y, mean, rstd};
}

LayerNormOutputs layer_norm_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                                     const at::Tensor& mean, const at::Tensor& rstd,
                                     at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias,
                                     std::array<bool, 3> output_mask) {
  const RowsCols rc = check_layer_norm_backward_args(grad_out, input, mean, rstd,
                                                     normalized_shape, weight, bias);
  const c10::cuda::CUDAGuard guard(input.device());
  check_kernel_image(input.get_device(), kOp);
  const bool want_dw = output_mask[1] && weight.has_value() && weight->defined();
  const bool want_db = output_mask[2] && bias.has_value() && bias->defined();
  const at::Tensor x = input.contiguous(), dy = grad_out.contiguous();
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const std::optional<at::Tensor> w =
      weight.has_value() && weight->defined() ? std::optional(weight->contiguous()) : std::nullopt;
  at::Tensor dx = output_mask[0] ? at::empty(input.sizes(), input.options())
                                 : at::empty({0}, input.options());
  const auto fopts = input.options().dtype(at::kFloat);
  auto empty_grad = [&] { return at::empty({0}, input.options()); };
  if (rc.rows == 0) {
    auto zeros_like_param = [&](bool want, const std::optional<at::Tensor>& p) {
      return want ? at::zeros(normalized_shape, p->options()) : empty_grad();
    };
    return {dx, zeros_like_param(want_dw, weight), zeros_like_param(want_db, bias)};
  }
  if (x.scalar_type() == at::kDouble) {  // the simple float64 kernels, not the tuned ones below
    at::Tensor dw = want_dw ? at::empty(normalized_shape, weight->options()) : empty_grad();
    at::Tensor db = want_db ? at::empty(normalized_shape, bias->options()) : empty_grad();
    layer_norm_bwd_cuda_f64(dy, x, mean_c, rstd_c, w.value_or(at::Tensor()),
                            output_mask[0] ? dx : at::Tensor(), want_dw ? dw : at::Tensor(),
                            want_db ? db : at::Tensor(), rc.rows, rc.cols);
    return {dx, dw, db};
  }

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int cols = static_cast<int>(rc.cols);
  const int wk = ln::param_kind(w, x.scalar_type());
  const void* wp = ln::param_ptr(w);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) &&
                       aligned16(dx.data_ptr()) && aligned16(wp);
  at::Tensor dw = want_dw ? at::empty(normalized_shape, weight->options()) : empty_grad();
  at::Tensor db = want_db ? at::empty(normalized_shape, bias->options()) : empty_grad();
  dispatch_dtype(x.scalar_type(), kOp, [&](auto in_tag) {
    using T = typename decltype(in_tag)::type;
    dispatch_dtype(dy.scalar_type(), kOp, [&](auto g_tag) {
      using G = typename decltype(g_tag)::type;
      if constexpr (std::is_same_v<G, T> || std::is_same_v<G, float>) {
        const ln::PlainSink<T> sink{output_mask[0] ? dx.data_ptr<T>() : nullptr};
        ln::launch_bwd(dy.data_ptr<G>(), x.data_ptr<T>(), mean_c.data_ptr<float>(),
                       rstd_c.data_ptr<float>(), wp, wk, sink, aligned,
                       want_dw ? dw : at::Tensor(), want_db ? db : at::Tensor(), rc.rows, cols,
                       fopts, "FASTLAYERS_LN_BWD_TPR", kOp, stream);
      } else {
        TORCH_CHECK(false, kOp, ": grad_out must have the input's dtype or float32");
      }
    });
  });
  return {dx, dw, db};
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
}

}  // namespace fastlayers
