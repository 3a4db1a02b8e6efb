// dropout + residual add + LayerNorm, CUDA kernels (semantics: dropout_add_layer_norm.h).
//
// Not a second LayerNorm: the op runs LayerNorm's own kernels (layer_norm_kernels.cuh, fast
// register-resident path and generic path, deterministic dweight/dbias partial sums) with two
// row policies defined here.
//   DropoutAddRows (forward source): a row vector is read as x and residual vectors; the mask
//     words of its elements are drawn (philox.h: element e is kept iff word e % 4 of Philox
//     group e / 4 is below the threshold), s = round_S(round_X(kept ? x * scale : 0) +
//     residual) is written to `sum` when wanted and handed to the LayerNorm statistics as
//     S-rounded floats. The row never goes through memory between the add and the norm.
//   DropoutAddSink (backward sink): the LayerNorm input gradient dv becomes ds = round_S(dv)
//     (+ grad_sum, rounded to S), grad_residual = ds and grad_x = kept ? round_X(round_X(ds) *
//     scale) : 0, with the mask regenerated from rng_state.
// (X, S) kernel pairs: (float, float), (half, half), (bf16, bf16), (half, float), (bf16, float);
// S = promote(x, residual) is always x's dtype or float32, so the only other case is a residual
// of a narrower dtype than S (float32 x + bf16 residual, bf16 x + fp16 residual): the residual
// is widened to S on the host first (an extra elementwise pass, exact). The fast path's vector
// is 16 bytes of the narrower of X and S (8 elements for half/bf16 x with a float32 sum).
// float64 sums (S double) take simple elementwise kernels around the float64 LayerNorm kernels
// of layer_norm_cuda_f64.cu.
//
// Random numbers. Only when training and p > 0: the forward takes philox_cuda_state(4) from the
// default CUDA generator under its lock (one Philox counter per group of 4 elements, see
// philox.h); the kernel unpacks it (at::cuda::philox::unpack: graph capture replays read the
// seed and offset from device memory) and block 0 writes (seed, offset) to the rng_state
// output, which the backward reads on the device. torch.manual_seed reproduces a run, and a
// captured CUDA graph draws a fresh mask on every replay with a backward that matches it.
//
// The mask is regenerated in the backward, not stored: a stored mask costs a write in the
// forward and a read in the backward (1 byte per element as uint8; 1 bit per element packed,
// with read-modify-free packing only per 8-element vector) on kernels that move 6 to 12 bytes
// per element; regenerating costs 10 Philox rounds per 4 elements (about 30 integer
// instructions per element) in the backward, which the forward pays anyway. The GPU benchmark
// decides whether the compute stays hidden under the memory traffic.
//
// Determinism: no atomics anywhere; the mask depends on (seed, offset, element index) only.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <type_traits>

#include "common/arch_check.h"
#include "common/common.h"
#include "common/cuda_utils.cuh"
#include "dropout_add_layer_norm/dropout_add_layer_norm.h"
#include "layer_norm/layer_norm.h"
#include "layer_norm/layer_norm_kernels.cuh"
#include "common/philox.h"
#include "rms_norm/rms_norm.h"
#include "rms_norm/rms_norm_cuda.cuh"

namespace fastlayers {

// Defined in dropout_add_layer_norm.cpp (with the op's other argument checks; not in the
// header, whose interface is fixed to the forward check).
RowsCols check_dropout_add_layer_norm_backward_args(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng_state,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double p, at::ScalarType x_dtype);

namespace {

constexpr const char* kOp = "fastlayers.dropout_add_layer_norm";

using cuda::load_floats;
using cuda::store_floats;
using cuda::vec_of;

// v rounded to U's precision, as float.
template <typename U>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same_v<U, float>) {
    return v;
  } else {
    return static_cast<float>(static_cast<U>(v));
  }
}

// Elements per fast-path vector: 16 bytes of the narrower dtype (the wider one moves 32).
template <typename X, typename S>
constexpr int dropout_vec() {
  return std::max(vec_of<X>(), vec_of<S>());
}

// The dropout parameters of one call, on the device. seed/offset are filled in by begin().
struct MaskParams {
  uint32_t threshold;  // philox::keep_threshold(p)
  float scale;         // 1 / (1 - p) in float (the compute type of float32/half/bf16 x), 0 if p = 1
  bool active;         // training and p > 0
  uint64_t seed = 0, offset = 0;

  // The 4 mask words of group g. The seed goes through an empty asm so that each call derives
  // its round keys itself (20 integer adds): otherwise the compiler hoists the 20 round keys
  // out of the row loop and keeps them in registers, which the rows in flight need (the
  // persistent backward went from 64 to 100 registers per thread).
  __device__ __forceinline__ philox::Words words(uint64_t g) const {
    uint64_t s = seed;
    asm volatile("" : "+l"(s));
    return philox::random4(s, offset, g);
  }
};

// ------------------------------------------------------------------------------------------
// Forward source: s = round_S(round_X(kept ? x * scale : 0) + residual).

template <typename X, typename S>
struct DropoutAddRows {
  using Param = S;
  using Held = S;  // s is rounded to S: held at its storage width, exactly
  static constexpr int kVec = dropout_vec<X, S>();
  // pick_config's items4_max_tpr (H200 sweep): 256 x 4 vectors beat 128 x 8 by 12-16% at a
  // 16-bit row of 8192 (the Philox and the sum's store take registers).
  static constexpr int kItems4MaxTpr = 256;
  const X* __restrict__ x;
  const S* __restrict__ residual;  // null: no residual (then S = X)
  // Where s is written: the sum output (store_sum), or on the generic path a scratch buffer
  // that the normalisation pass reads back; null on the fast path without store_sum.
  S* sum;
  at::PhiloxCudaState philox;
  int64_t* rng_out;  // (seed, offset) written here by block 0 when the mask is drawn
  MaskParams mask;

  // d = round_X(kept ? x * scale : 0), the dropped-out x (x itself without dropout).
  __device__ __forceinline__ float drop(float xv, uint32_t word) const {
    return word < mask.threshold ? round_to<X>(xv * mask.scale) : 0.f;
  }

  struct Row {
    const DropoutAddRows& p;
    int64_t base;  // flattened index of the row's first element

    // Fast path: base + vi * kVec is a multiple of 4 (cols % kVec == 0), so the vector covers
    // kVec / 4 whole Philox groups.
    __device__ __forceinline__ cuda::RawVec<S, kVec> load_raw(int vi) const {
      const int64_t i = base + static_cast<int64_t>(vi) * kVec;
      if constexpr (std::is_same_v<X, S> && sizeof(S) == 2) {
        // No dropout, one 16-bit dtype (add + RMSNorm's call): s = round_S(x + residual) is S's
        // own packed add on the raw words (cuda_utils.cuh: the same bits), no conversions.
        if (!p.mask.active && p.residual != nullptr) {
          const cuda::RawVec<S, kVec> xr = cuda::load_raw<S, kVec>(p.x + i);
          const cuda::RawVec<S, kVec> rr = cuda::load_raw<S, kVec>(p.residual + i);
          cuda::RawVec<S, kVec> r;
#pragma unroll
          for (int w = 0; w < kVec / 2; ++w)
            cuda::words_of(r)[w] = cuda::add2<S>(cuda::words_of(xr)[w], cuda::words_of(rr)[w]);
          if (p.sum != nullptr) cuda::store_raw<S, kVec>(p.sum + i, r);
          return r;
        }
      }
      float v[kVec];
      float xv[kVec];
      load_floats<X, kVec>(p.x + i, xv);
      if (p.mask.active) {
#pragma unroll
        for (int c = 0; c < kVec / 4; ++c) {
          const philox::Words w = p.mask.words(static_cast<uint64_t>(i / 4 + c));
#pragma unroll
          for (int k = 0; k < 4; ++k) xv[4 * c + k] = p.drop(xv[4 * c + k], w.w[k]);
        }
      }
      if (p.residual != nullptr) {
        float rv[kVec];
        load_floats<S, kVec>(p.residual + i, rv);
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] = round_to<S>(xv[k] + rv[k]);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[k] = round_to<S>(xv[k]);
      }
      const cuda::RawVec<S, kVec> r = cuda::pack_floats<S, kVec>(v);
      if (p.sum != nullptr) cuda::store_raw<S, kVec>(p.sum + i, r);
      return r;
    }

    // Generic path: one Philox call per group of 4 elements; the thread takes groups
    // (first group of the row) + threadIdx.x, + blockDim.x, ... and the row's elements in them.
    template <typename F>
    __device__ __forceinline__ void for_each(int cols, F&& f) const {
      const int64_t end = base + cols;
      for (int64_t g = base / 4 + threadIdx.x; 4 * g < end; g += blockDim.x) {
        philox::Words w{};
        if (p.mask.active) w = p.mask.words(static_cast<uint64_t>(g));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int64_t e = 4 * g + k;
          if (e < base || e >= end) continue;
          float d = static_cast<float>(p.x[e]);
          if (p.mask.active) d = p.drop(d, w.w[k]);
          const float s = round_to<S>(p.residual != nullptr
                                          ? d + static_cast<float>(p.residual[e])
                                          : d);
          p.sum[e] = static_cast<S>(s);
          f(s);
        }
      }
    }

    // s of element j, written by for_each (of this block, before a __syncthreads).
    __device__ __forceinline__ float reload(int j) const {
      return static_cast<float>(p.sum[base + j]);
    }
  };

  __device__ __forceinline__ void begin() {
    if (!mask.active) {
      // No mask drawn: (0, 0), written here rather than by an at::zeros on the host, which
      // would be one more launch on every call (add + RMSNorm has no rng_state output: null)
      if (rng_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) rng_out[0] = rng_out[1] = 0;
      return;
    }
    const auto seeds = at::cuda::philox::unpack(philox);
    mask.seed = std::get<0>(seeds);
    mask.offset = std::get<1>(seeds);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      rng_out[0] = static_cast<int64_t>(mask.seed);
      rng_out[1] = static_cast<int64_t>(mask.offset);
    }
  }
  __device__ __forceinline__ Row row(int64_t row, int cols) const { return Row{*this, row * cols}; }
};

// ------------------------------------------------------------------------------------------
// Backward sink: ds = round_S(dv) (+ grad_sum), grad_residual = ds, grad_x = dropout'(ds).

template <typename X, typename S>
struct DropoutAddSink {
  static constexpr int kVec = dropout_vec<X, S>();
  X* grad_x;                       // null: not wanted
  S* grad_residual;                // null: not wanted
  const S* __restrict__ grad_sum;  // null: none (no prenorm output gradient)
  const int64_t* rng_state;        // (seed, offset) of the forward's mask
  MaskParams mask;

  __device__ __forceinline__ float ds_of(float dv, int64_t e) const {
    float ds = round_to<S>(dv);
    if (grad_sum != nullptr) ds = round_to<S>(ds + static_cast<float>(grad_sum[e]));
    return ds;
  }
  // grad_x of one element (rounded to X by its store).
  __device__ __forceinline__ float gx_of(float ds, uint32_t word) const {
    if (!mask.active) return ds;
    return word < mask.threshold ? round_to<X>(ds) * mask.scale : 0.f;
  }

  struct Row {
    const DropoutAddSink& p;
    int64_t base;

    __device__ __forceinline__ void store(int vi, const float (&dv)[kVec]) const {
      const int64_t i = base + static_cast<int64_t>(vi) * kVec;
      float ds[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) ds[k] = round_to<S>(dv[k]);
      if (p.grad_sum != nullptr) {
        float gs[kVec];
        load_floats<S, kVec>(p.grad_sum + i, gs);
#pragma unroll
        for (int k = 0; k < kVec; ++k) ds[k] = round_to<S>(ds[k] + gs[k]);
      }
      if (p.grad_residual != nullptr) store_floats<S, kVec>(p.grad_residual + i, ds);
      if (p.grad_x != nullptr) {
        float gx[kVec];
        if (p.mask.active) {
#pragma unroll
          for (int c = 0; c < kVec / 4; ++c) {
            const philox::Words w = p.mask.words(static_cast<uint64_t>(i / 4 + c));
#pragma unroll
            for (int k = 0; k < 4; ++k) gx[4 * c + k] = p.gx_of(ds[4 * c + k], w.w[k]);
          }
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k) gx[k] = ds[k];
        }
        store_floats<X, kVec>(p.grad_x + i, gx);
      }
    }

    template <typename F>
    __device__ __forceinline__ void for_each(int cols, F&& f) const {
      const int64_t end = base + cols;
      for (int64_t g = base / 4 + threadIdx.x; 4 * g < end; g += blockDim.x) {
        philox::Words w{};
        if (p.mask.active && p.grad_x != nullptr) w = p.mask.words(static_cast<uint64_t>(g));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int64_t e = 4 * g + k;
          if (e < base || e >= end) continue;
          const float ds = p.ds_of(f(static_cast<int>(e - base)), e);
          if (p.grad_residual != nullptr) p.grad_residual[e] = static_cast<S>(ds);
          if (p.grad_x != nullptr) p.grad_x[e] = static_cast<X>(p.gx_of(ds, w.w[k]));
        }
      }
    }
  };

  __host__ __device__ __forceinline__ bool enabled() const {
    return grad_x != nullptr || grad_residual != nullptr;
  }
  // The fast backward holds its rows in registers and keeps rows in flight by occupancy: left
  // free, the compiler gave this sink's kernels 72 to 108 registers (LayerNorm's own: at most
  // 64, i.e. half the rows per SM at 512 threads). Asking for 64 (65536 / 64 / threads blocks)
  // costs 24 to 32 bytes of spills in the two-vector configurations (ptxas, sm_90a). Which is
  // faster is for the GPU benchmark to say.
  static constexpr int min_blocks(int threads) { return threads >= 1024 ? 1 : 1024 / threads; }
  __device__ __forceinline__ void begin() {
    if (mask.active && grad_x != nullptr) {
      mask.seed = static_cast<uint64_t>(rng_state[0]);
      mask.offset = static_cast<uint64_t>(rng_state[1]);
    }
  }
  __device__ __forceinline__ Row row(int64_t row, int cols) const { return Row{*this, row * cols}; }
};

// ------------------------------------------------------------------------------------------
// float64 sums: elementwise kernels around the float64 LayerNorm kernels. One thread per
// group of 4 elements (one Philox call), grid-stride.

constexpr int kF64Threads = 256;

int64_t f64_blocks(int64_t n) {
  const int64_t groups = (n + 3) / 4;
  return std::max<int64_t>(1, std::min<int64_t>((groups + kF64Threads - 1) / kF64Threads,
                                                int64_t{ln::sm_count()} * 32));
}

// s[e] = round_X(kept ? x[e] * scale : 0) + r[e] in double (r may be null).
template <typename X>
__global__ void __launch_bounds__(kF64Threads)
    dropout_add_f64_kernel(const X* __restrict__ x, const double* __restrict__ r,
                           double* __restrict__ s, int64_t n, at::PhiloxCudaState philox,
                           int64_t* rng_out, uint32_t threshold, double scale, bool active) {
  using A = at::opmath_type<X>;
  uint64_t seed = 0, offset = 0;
  if (active) {
    const auto seeds = at::cuda::philox::unpack(philox);
    seed = std::get<0>(seeds);
    offset = std::get<1>(seeds);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {  // (0, 0) without a mask, as begin() above
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }
  const A sc = static_cast<A>(scale);
  const int64_t groups = (n + 3) / 4;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    philox::Words w{};
    if (active) w = philox::random4(seed, offset, static_cast<uint64_t>(g));
    for (int k = 0; k < 4; ++k) {
      const int64_t e = 4 * g + k;
      if (e >= n) break;
      double d = static_cast<double>(x[e]);
      if (active)
        d = w.w[k] < threshold ? static_cast<double>(static_cast<X>(static_cast<A>(x[e]) * sc))
                               : 0.0;
      s[e] = r != nullptr ? d + r[e] : d;
    }
  }
}

// ds = dv + gs (gs may be null); gr[e] = ds (gr may be null or dv itself); gx[e] =
// kept ? round_X(round_X(ds) * scale) : 0 (gx may be null).
template <typename X>
__global__ void __launch_bounds__(kF64Threads)
    dropout_grad_f64_kernel(const double* dv, const double* __restrict__ gs, double* gr, X* gx,
                            int64_t n, const int64_t* __restrict__ rng_state, uint32_t threshold,
                            double scale, bool active) {
  using A = at::opmath_type<X>;
  uint64_t seed = 0, offset = 0;
  if (active && gx != nullptr) {
    seed = static_cast<uint64_t>(rng_state[0]);
    offset = static_cast<uint64_t>(rng_state[1]);
  }
  const A sc = static_cast<A>(scale);
  const int64_t groups = (n + 3) / 4;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    philox::Words w{};
    if (active && gx != nullptr) w = philox::random4(seed, offset, static_cast<uint64_t>(g));
    for (int k = 0; k < 4; ++k) {
      const int64_t e = 4 * g + k;
      if (e >= n) break;
      const double ds = gs != nullptr ? dv[e] + gs[e] : dv[e];
      if (gr != nullptr) gr[e] = ds;
      if (gx != nullptr) {
        if (!active) {
          gx[e] = static_cast<X>(ds);
        } else {
          gx[e] = w.w[k] < threshold ? static_cast<X>(static_cast<A>(static_cast<X>(ds)) * sc)
                                     : static_cast<X>(0);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Host helpers.

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A weight/bias as the kernels read it: contiguous, in the sum's dtype or float32 (float64 sums:
// float64). The argument checks allow only those; anything else is converted (small tensors).
std::optional<at::Tensor> param_for(const std::optional<at::Tensor>& p, at::ScalarType sum) {
  if (!present(p)) return std::nullopt;
  const at::ScalarType pt = p->scalar_type();
  if (sum == at::kDouble) return p->to(at::kDouble).contiguous();
  if (pt == sum || pt == at::kFloat) return p->contiguous();
  return p->to(at::kFloat).contiguous();
}

// t in dtype st, contiguous (no copy when it already is). Not to(..., MemoryFormat::Contiguous)
// alone: that returns t itself when only the dtype is asked for and t's suggested format is
// contiguous, as it is for an expanded (stride 0) tensor such as autograd's gradient of a sum.
at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType st) {
  return t.to(st).contiguous();
}

// 1 / (1 - p) (p = 1: 0, never used: nothing is kept).
double keep_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

// Philox state for one call from the default CUDA generator of the current device: 4 offset
// units (one counter per 4 elements; philox.h).
at::PhiloxCudaState draw_philox_state() {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->philox_cuda_state(4);
}

// Calls f(TypeTag<X>, TypeTag<S>) for the kernel pairs: S is X or float32.
template <typename F>
void dispatch_x_s(at::ScalarType x, at::ScalarType s, F&& f) {
  dispatch_dtype(x, kOp, [&](auto x_tag) {
    using X = typename decltype(x_tag)::type;
    if (s == x) {
      f(x_tag, x_tag);
    } else {
      TORCH_CHECK(s == at::kFloat, kOp, ": internal error: no kernel for x ", x, " and sum ", s);
      f(x_tag, TypeTag<float>{});
    }
  });
}

using cuda::aligned16;

// The float64-sum forward: s in double, then the float64 LayerNorm.
void fwd_f64(const at::Tensor& x, const at::Tensor& res, const at::Tensor& s,
             const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b, double eps,
             bool drop, double p, const at::Tensor& y, const at::Tensor& mean,
             const at::Tensor& rstd, const at::Tensor& rng_state, int64_t rows, int64_t cols) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::PhiloxCudaState philox = drop ? draw_philox_state() : at::PhiloxCudaState();
  const int64_t n = x.numel();
  dispatch_dtype_f64(x.scalar_type(), kOp, [&](auto x_tag) {
    using X = typename decltype(x_tag)::type;
    dropout_add_f64_kernel<X><<<f64_blocks(n), kF64Threads, 0, stream>>>(
        x.data_ptr<X>(), res.defined() ? res.data_ptr<double>() : nullptr, s.data_ptr<double>(),
        n, philox, rng_state.data_ptr<int64_t>(), philox::keep_threshold(p), keep_scale(p),
        drop);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const at::Tensor y64 = y.scalar_type() == at::kDouble ? y : at::empty_like(y, at::kDouble);
  layer_norm_fwd_cuda_f64(s, w.value_or(at::Tensor()), b.value_or(at::Tensor()), eps, y64, mean,
                          rstd, rows, cols);
  if (!y64.is_same(y)) y.copy_(y64);
}

}  // namespace

DropoutAddLayerNormOutputs dropout_add_layer_norm_fwd_cuda(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double p, bool training, bool store_sum,
    std::optional<at::ScalarType> out_dtype) {
  const RowsCols rc = check_dropout_add_layer_norm_args(x_in, residual_in, normalized_shape,
                                                        weight, bias, p, out_dtype);
  const c10::cuda::CUDAGuard guard(x_in.device());
  check_kernel_image(x_in.get_device(), kOp);
  const at::ScalarType st = dropout_add_sum_dtype(x_in, residual_in);
  const at::ScalarType ot = out_dtype.value_or(st);
  const at::Tensor x = x_in.contiguous();
  // A residual of a narrower dtype than S is widened first (exact; see the file comment).
  const at::Tensor res = present(residual_in) ? contiguous_as(*residual_in, st) : at::Tensor();
  const std::optional<at::Tensor> w = param_for(weight, st), b = param_for(bias, st);
  const auto sopts = x.options().dtype(st);
  const auto stat_opts = x.options().dtype(layer_norm_stat_dtype(st));
  const auto sizes = x.sizes();
  const std::vector<int64_t> stat_shape(sizes.begin(), sizes.end() - normalized_shape.size());
  at::Tensor y = at::empty(sizes, x.options().dtype(ot));
  at::Tensor mean = at::empty(stat_shape, stat_opts), rstd = at::empty(stat_shape, stat_opts);
  at::Tensor sum = store_sum ? at::empty(sizes, sopts) : at::empty({0}, sopts);
  // (seed, offset), or (0, 0) without dropout: written by the forward kernel (block 0). Nothing
  // to draw for an empty tensor: zeros, as without dropout (no kernel runs then).
  const bool drop = dropout_active(p, training) && rc.rows > 0;
  at::Tensor rng_state = at::empty({2}, x.options().dtype(at::kLong));
  if (rc.rows == 0) return {y, sum, mean, rstd, rng_state.zero_()};

  if (st == at::kDouble) {
    const at::Tensor s = store_sum ? sum : at::empty(sizes, sopts);
    fwd_f64(x, res, s, w, b, eps, drop, p, y, mean, rstd, rng_state, rc.rows, rc.cols);
    return {y, sum, mean, rstd, rng_state};
  }

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int cols = static_cast<int>(rc.cols);
  const int wk = ln::param_kind(w, st), bk = ln::param_kind(b, st);
  const void* wp = ln::param_ptr(w);
  const void* bp = ln::param_ptr(b);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(res.defined() ? res.data_ptr() : nullptr) &&
                       aligned16(store_sum ? sum.data_ptr() : nullptr) &&
                       aligned16(y.data_ptr()) && aligned16(wp) && aligned16(bp);
  const MaskParams mask{philox::keep_threshold(p), static_cast<float>(keep_scale(p)), drop};
  const at::PhiloxCudaState philox = drop ? draw_philox_state() : at::PhiloxCudaState();
  int64_t* rng_out = rng_state.data_ptr<int64_t>();
  dispatch_x_s(x.scalar_type(), st, [&](auto x_tag, auto s_tag) {
    using X = typename decltype(x_tag)::type;
    using S = typename decltype(s_tag)::type;
    using Src = DropoutAddRows<X, S>;
    // 16-bit sums: 4 vectors a thread up to 512 threads (H200, 16,384 bf16 columns: 512 x 4
    // beat 256 x 8 by 20-22%, training and eval); add + RMSNorm, same Src, keeps Src's 256
    // (there 256 x 8 is faster)
    const auto cfg = ln::fwd_vec_config<Src>(cols, aligned, "FASTLAYERS_DALN_FWD_TPR",
                                             sizeof(S) == 2 ? 512 : 0);
    // The generic path reads s back for the normalisation: a scratch row buffer when the sum
    // output is not kept.
    const at::Tensor s_buf = store_sum || cfg ? sum : at::empty(sizes, sopts);
    const Src src{x.data_ptr<X>(),
                  res.defined() ? res.data_ptr<S>() : nullptr,
                  store_sum || !cfg ? s_buf.data_ptr<S>() : nullptr,
                  philox,
                  rng_out,
                  mask};
    dispatch_dtype(ot, kOp, [&](auto o_tag) {
      using O = typename decltype(o_tag)::type;
      if constexpr (std::is_same_v<O, S> || std::is_same_v<O, float>) {
        ln::launch_fwd<O>(src, cfg, wp, bp, wk, bk, y.data_ptr<O>(), mean.data_ptr<float>(),
                          rstd.data_ptr<float>(), rc.rows, cols, static_cast<float>(eps), kOp,
                          stream);
      } else {
        TORCH_CHECK(false, kOp, ": out_dtype must be the sum's dtype or float32");
      }
    });
  });
  return {y, sum, mean, rstd, rng_state};
}

DropoutAddLayerNormGrads dropout_add_layer_norm_bwd_cuda(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng_state,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double p, bool dropout, at::ScalarType x_dtype,
    std::array<bool, 4> output_mask) {
  const RowsCols rc = check_dropout_add_layer_norm_backward_args(
      grad_y, grad_sum, sum, mean, rstd, rng_state, normalized_shape, weight, bias, p, x_dtype);
  const c10::cuda::CUDAGuard guard(sum.device());
  check_kernel_image(sum.get_device(), kOp);
  const at::ScalarType st = sum.scalar_type();
  const bool want_gx = output_mask[0], want_gr = output_mask[1];
  const bool want_dw = output_mask[2] && present(weight);
  const bool want_db = output_mask[3] && present(bias);
  const auto empty = [&] { return at::empty({0}, sum.options()); };
  at::Tensor gx = want_gx ? at::empty(sum.sizes(), sum.options().dtype(x_dtype)) : empty();
  at::Tensor gr = want_gr ? at::empty(sum.sizes(), sum.options()) : empty();
  if (rc.rows == 0) {
    auto zeros_like_param = [&](bool want, const std::optional<at::Tensor>& p) {
      return want ? at::zeros(normalized_shape, p->options()) : empty();
    };
    return {gx, gr, zeros_like_param(want_dw, weight), zeros_like_param(want_db, bias)};
  }
  const at::Tensor s = sum.contiguous();
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const at::Tensor gs = present(grad_sum) ? contiguous_as(*grad_sum, st) : at::Tensor();
  const at::Tensor rng = rng_state.contiguous();
  const std::optional<at::Tensor> w = param_for(weight, st);
  at::Tensor dw = want_dw ? at::empty(normalized_shape, weight->options()) : empty();
  at::Tensor db = want_db ? at::empty(normalized_shape, bias->options()) : empty();
  const bool active = dropout && p > 0.0;
  const uint32_t threshold = philox::keep_threshold(p);

  if (st == at::kDouble) {
    const at::Tensor dy = contiguous_as(grad_y, at::kDouble);
    const bool want_ds = want_gx || want_gr;
    const at::Tensor dv = want_gr ? gr : (want_ds ? at::empty(s.sizes(), s.options()) : at::Tensor());
    // The float64 kernels write float64 parameter gradients (the checks make weight/bias
    // float64 for a float64 sum).
    const at::Tensor dw64 = want_dw ? contiguous_as(dw, at::kDouble) : at::Tensor();
    const at::Tensor db64 = want_db ? contiguous_as(db, at::kDouble) : at::Tensor();
    layer_norm_bwd_cuda_f64(dy, s, mean_c, rstd_c, w.value_or(at::Tensor()), dv, dw64, db64,
                            rc.rows, rc.cols);
    if (want_dw && !dw64.is_same(dw)) dw.copy_(dw64);
    if (want_db && !db64.is_same(db)) db.copy_(db64);
    if (want_ds) {
      const int64_t n = s.numel();
      const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
      dispatch_dtype_f64(x_dtype, kOp, [&](auto x_tag) {
        using X = typename decltype(x_tag)::type;
        dropout_grad_f64_kernel<X><<<f64_blocks(n), kF64Threads, 0, stream>>>(
            dv.data_ptr<double>(), gs.defined() ? gs.data_ptr<double>() : nullptr,
            want_gr ? gr.data_ptr<double>() : nullptr, want_gx ? gx.data_ptr<X>() : nullptr, n,
            rng.data_ptr<int64_t>(), threshold, keep_scale(p), active);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    return {gx, gr, dw, db};
  }

  // grad_y in S or float32 (the checks allow those only).
  const at::Tensor dy = grad_y.scalar_type() == at::kFloat ? grad_y.contiguous()
                                                            : contiguous_as(grad_y, st);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int cols = static_cast<int>(rc.cols);
  const int wk = ln::param_kind(w, st);
  const void* wp = ln::param_ptr(w);
  const bool aligned = aligned16(s.data_ptr()) && aligned16(dy.data_ptr()) && aligned16(wp) &&
                       aligned16(want_gx ? gx.data_ptr() : nullptr) &&
                       aligned16(want_gr ? gr.data_ptr() : nullptr) &&
                       aligned16(gs.defined() ? gs.data_ptr() : nullptr);
  const MaskParams mask{threshold, static_cast<float>(keep_scale(p)), active};
  const auto fopts = sum.options().dtype(at::kFloat);
  dispatch_x_s(x_dtype, st, [&](auto x_tag, auto s_tag) {
    using X = typename decltype(x_tag)::type;
    using S = typename decltype(s_tag)::type;
    const DropoutAddSink<X, S> sink{want_gx ? gx.data_ptr<X>() : nullptr,
                                    want_gr ? gr.data_ptr<S>() : nullptr,
                                    gs.defined() ? gs.data_ptr<S>() : nullptr,
                                    rng.data_ptr<int64_t>(), mask};
    dispatch_dtype(dy.scalar_type(), kOp, [&](auto g_tag) {
      using G = typename decltype(g_tag)::type;
      if constexpr (std::is_same_v<G, S> || std::is_same_v<G, float>) {
        ln::launch_bwd(dy.data_ptr<G>(), s.data_ptr<S>(), mean_c.data_ptr<float>(),
                       rstd_c.data_ptr<float>(), wp, wk, sink, aligned,
                       want_dw ? dw : at::Tensor(), want_db ? db : at::Tensor(), rc.rows, cols,
                       fopts, "FASTLAYERS_DALN_BWD_TPR", kOp, stream);
      } else {
        TORCH_CHECK(false, kOp, ": grad_y must have the sum's dtype or float32");
      }
    });
  });
  return {gx, gr, dw, db};
}

// ------------------------------------------------------------------------------------------
// Residual add + RMSNorm (csrc/rms_norm/add_rms_norm.cpp): the same row policies without a
// mask, with the RMS statistics and the form's affine; calls the kernels do not take (mixed or
// float64 dtypes, other output dtypes) run the composite on the GPU.

namespace {
constexpr const char* kAddRmsOp = "fastlayers.add_rms_norm";
}  // namespace

AddRmsNormOutputs add_rms_norm_fwd_cuda(const at::Tensor& x_in, const at::Tensor& residual_in,
                                        at::IntArrayRef normalized_shape,
                                        const std::optional<at::Tensor>& weight,
                                        std::optional<double> eps, int64_t form) {
  const auto rc = check_add_rms_norm_args(x_in, residual_in, normalized_shape, weight, form);
  const c10::cuda::CUDAGuard guard(x_in.device());
  check_kernel_image(x_in.get_device(), kAddRmsOp);
  const RmsNormForm f = rms_norm_form(form);
  const at::ScalarType st = x_in.scalar_type();
  const at::ScalarType ot = rms_norm_out_dtype(f, st, weight, std::nullopt);
  if (residual_in.scalar_type() != st || !rms::kernels_take(st, weight, ot)) {
    return add_rms_norm_fwd_composite(x_in, residual_in, normalized_shape, weight, eps, form);
  }
  const at::Tensor x = x_in.contiguous(), res = residual_in.contiguous();
  const std::optional<at::Tensor> w = rms::kernel_weight(weight, st);
  const auto sizes = x.sizes();
  at::Tensor y = at::empty(sizes, x.options().dtype(ot));
  at::Tensor sum = at::empty(sizes, x.options());
  at::Tensor rstd = at::empty(sizes.slice(0, sizes.size() - normalized_shape.size()),
                              x.options().dtype(at::kFloat));
  if (rc[0] == 0) return {y, sum, rstd};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int cols = static_cast<int>(rc[1]);
  const int wk = ln::param_kind(w, st);
  const void* wp = ln::param_ptr(w);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(res.data_ptr()) &&
                       aligned16(sum.data_ptr()) && aligned16(y.data_ptr()) && aligned16(wp);
  const ln::RmsForm rf = rms::kernel_form(f, st, weight);
  const float e = static_cast<float>(rms_norm_eps(eps, st));
  const MaskParams no_mask{0u, 0.f, false};
  dispatch_dtype(st, kAddRmsOp, [&](auto s_tag) {
    using S = typename decltype(s_tag)::type;
    using Src = DropoutAddRows<S, S>;
    const auto cfg = ln::fwd_vec_config<Src>(cols, aligned, "FASTLAYERS_ADD_RMS_FWD_TPR");
    const Src src{x.data_ptr<S>(), res.data_ptr<S>(), sum.data_ptr<S>(), at::PhiloxCudaState(),
                  nullptr, no_mask};
    dispatch_dtype(ot, kAddRmsOp, [&](auto o_tag) {
      using O = typename decltype(o_tag)::type;
      if constexpr (std::is_same_v<O, S>) {
        ln::launch_fwd<O, Src, true>(src, cfg, wp, nullptr, wk, ln::kParamNone,
                                     y.data_ptr<O>(), nullptr, rstd.data_ptr<float>(), rc[0],
                                     cols, e, kAddRmsOp, stream, rf);
      }
    });
  });
  return {y, sum, rstd};
}

AddRmsNormOutputs add_rms_norm_bwd_cuda(const at::Tensor& grad_y,
                                        const std::optional<at::Tensor>& grad_sum,
                                        const at::Tensor& sum, const at::Tensor& rstd,
                                        at::IntArrayRef normalized_shape,
                                        const std::optional<at::Tensor>& weight, int64_t form,
                                        std::array<bool, 3> output_mask) {
  check_add_rms_norm_backward_args(grad_y, grad_sum, sum, rstd, normalized_shape, weight, form);
  const c10::cuda::CUDAGuard guard(sum.device());
  check_kernel_image(sum.get_device(), kAddRmsOp);
  const RmsNormForm f = rms_norm_form(form);
  const at::ScalarType st = sum.scalar_type();
  if (!rms::kernels_take(st, weight, grad_y.scalar_type()) || rstd.scalar_type() != at::kFloat) {
    return add_rms_norm_bwd_composite(grad_y, grad_sum, sum, rstd, normalized_shape, weight,
                                      form, output_mask);
  }
  const bool want_ds = output_mask[0] || output_mask[1];
  const bool want_dw = output_mask[2] && present(weight);
  const auto empty = [&] { return at::empty({0}, sum.options()); };
  at::Tensor ds = want_ds ? at::empty(sum.sizes(), sum.options()) : empty();
  at::Tensor dw = want_dw ? at::empty(normalized_shape, weight->options()) : empty();
  const int64_t rows = rstd.numel();
  const int cols = static_cast<int>(rows == 0 ? 0 : sum.numel() / rows);
  auto result = [&] {
    return AddRmsNormOutputs{output_mask[0] ? ds : empty(), output_mask[1] ? ds : empty(), dw};
  };
  if (rows == 0 || cols == 0) {
    if (want_dw) dw.zero_();
    return result();
  }
  const at::Tensor s = sum.contiguous(), r = rstd.contiguous();
  const at::Tensor gs = present(grad_sum) ? contiguous_as(*grad_sum, st) : at::Tensor();
  const at::Tensor dy = grad_y.contiguous();  // the sum's dtype (kernels_take)
  const std::optional<at::Tensor> w = rms::kernel_weight(weight, st);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int wk = ln::param_kind(w, st);
  const void* wp = ln::param_ptr(w);
  const bool aligned = aligned16(s.data_ptr()) && aligned16(dy.data_ptr()) && aligned16(wp) &&
                       aligned16(want_ds ? ds.data_ptr() : nullptr) &&
                       aligned16(gs.defined() ? gs.data_ptr() : nullptr);
  const ln::RmsForm rf = rms::kernel_form(f, st, weight);
  const MaskParams no_mask{0u, 0.f, false};
  dispatch_dtype(st, kAddRmsOp, [&](auto s_tag) {
    using S = typename decltype(s_tag)::type;
    // dsum goes to grad_x alone: x and residual get the very same gradient tensor
    const DropoutAddSink<S, S> sink{want_ds ? ds.data_ptr<S>() : nullptr, nullptr,
                                    gs.defined() ? gs.data_ptr<S>() : nullptr, nullptr, no_mask};
    dispatch_dtype(dy.scalar_type(), kAddRmsOp, [&](auto g_tag) {
      using G = typename decltype(g_tag)::type;
      if constexpr (std::is_same_v<G, S>) {
        ln::launch_bwd<S, G, DropoutAddSink<S, S>, true>(
            dy.data_ptr<G>(), s.data_ptr<S>(), nullptr, r.data_ptr<float>(), wp, wk, sink,
            aligned, want_dw ? dw : at::Tensor(), at::Tensor(), rows, cols,
            sum.options().dtype(at::kFloat), "FASTLAYERS_ADD_RMS_BWD_TPR", kAddRmsOp, stream,
            rf);
      }
    });
  });
  return result();
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("dropout_add_layer_norm_fwd", &dropout_add_layer_norm_fwd_cuda);
  m.impl("dropout_add_layer_norm_bwd", &dropout_add_layer_norm_bwd_cuda);
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd_cuda);
  m.impl("add_rms_norm_bwd", &add_rms_norm_bwd_cuda);
}

}  // namespace fastlayers
