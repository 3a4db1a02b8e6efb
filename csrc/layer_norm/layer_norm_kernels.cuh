// LayerNorm CUDA kernels and their host launchers, shared by the op families that normalise rows:
// fastlayers.layer_norm (layer_norm_cuda.cu) and fastlayers.dropout_add_layer_norm
// (dropout_add_layer_norm_cuda.cu).
//
// Fast path (cols a multiple of the vector width, 16-byte aligned pointers, row fits in
// registers): a row is held in registers by TPR threads (TPR = 32 .. 1024), each holding ITEMS
// vectors, so the row is read from memory once. Mean and variance come from one merged
// reduction of per-thread (count, mean, M2): exact two-pass numerics, one reduction round.
// Backward runs on a persistent grid; each block keeps its columns' dweight/dbias sums in
// shared memory over its rows and writes one partial row; a second kernel sums the partial rows
// in a fixed order. No atomics: gradients are bit-identical run to run.
//
// Generic path (any width or alignment, rows too wide for registers): block per row with
// strided loops, and a column kernel for dweight/dbias partials.
//
// Row policies. The kernels do not read the LayerNorm input x or write its gradient dx
// themselves; the forward takes the row from a *source* policy and the backward hands dx to a
// *sink* policy, so an op that computes x on the fly (dropout + residual add) or post-processes
// dx runs these kernels instead of a copy of them. PlainRows / PlainSink below are LayerNorm's
// own: each method is the code the kernels had inline (a pointer, a load or a store), so the
// LayerNorm instantiations compile to the same work as before the policies.
//
//   Source (forward):
//     using Param;                  dtype of a kParamSame weight/bias (the LayerNorm input's)
//     using Held;                   dtype the fast path holds the row in (registers): every
//                                   value of the row is exactly representable in it
//     static constexpr int kVec;    elements per vector on the fast path (a multiple of 16 bytes
//                                   of every dtype the policy reads or writes)
//     __device__ void begin();      once per thread at kernel start
//     __device__ Row row(int64_t row, int cols) const, with
//       RawVec<Held, kVec> load_raw(int vi)   fast path: vector vi of the row
//       void for_each(int cols, F f)          generic: f(v) once for each of this thread's
//                                             elements (blockDim-strided, any order)
//       float reload(int j)                   generic: element j again (called after a
//                                             __syncthreads that follows for_each)
//   Sink (backward):
//     static constexpr int kVec;
//     static constexpr int min_blocks(int threads);  the fast kernel's launch bounds minimum of
//                                                 resident blocks per SM (0: none)
//     __host__ __device__ bool enabled() const;  whether dx is written at all
//     __device__ void begin();
//     __device__ Row row(int64_t row, int cols) const, with
//       void store(int vi, const float (&dx)[kVec])   fast path
//       void for_each(int cols, F f)                  generic: stores f(j) (the float dx of
//                                                     element j) for this thread's elements
//
// RMSNorm (csrc/rms_norm) runs the same kernels with RMS = true: no mean (the statistics are the
// row's mean square, no mean is written or read, dx has no mean term, no dbias) and the affine
// form of an RmsForm, which reproduces a model's rounding order.
//
// The kernels live in an unnamed namespace: each .cu that includes this gets its own instances
// (host stubs of a template kernel instantiated in two translation units are not merged).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/cuda_utils.cuh"

namespace fastlayers {
namespace ln {

// ------------------------------------------------------------------------------------------
// Host helpers defined once in layer_norm_cuda.cu.

struct VecConfig {
  int tpr;
  int items;
};

// Whether the fast kernels are compiled for TPR threads per row holding ITEMS vectors each.
// Backward: 1-2 vectors at every TPR. Forward, to keep the build small: what pick_config
// chooses (1-2 vectors at 32 threads, 4 at 32-1024: 512-1024 where a row held as floats in
// 16-byte vectors of 8 allows no more, 8 at 128-512) and the neighbours a knob may force (1-2
// vectors at 64-128). Not compiled: 1-2 vectors at 256-1024 threads, 1.3-3x slower than the
// automatic choice at every shape of the H200 sweep.
constexpr bool has_vec_kernel(int tpr, int items, bool fwd) {
  if (!fwd || items == 4) return true;
  if (items <= 2) return tpr <= 128;
  return tpr >= 128 && tpr <= 512;
}

// Threads per row whose registers hold the row (none if it is too wide or the vector width
// does not divide it): the smallest that holds it in at most 4 vectors each while that is at
// most `items4_max_tpr` threads, else the smallest that holds it in at most max_elems. (H200
// sweep, tools/tune_row_kernels.py: 4 vectors a thread is fastest up to that block size;
// beyond it, 8 vectors in half the threads beat 4 in blocks of 512 or 1024 by 12-45%.)
// `env_tpr` (a benchmarking knob, e.g. FASTLAYERS_LN_FWD_TPR=256) forces the threads per row
// where the row still fits.
// `fwd`: the forward's kernel set (has_vec_kernel).
std::optional<VecConfig> pick_config(int64_t cols, int vec, int max_elems, int max_tpr,
                                     const char* env_tpr, int items4_max_tpr = 1024,
                                     bool fwd = false);

int sm_count();

// Resident blocks per SM for a kernel with `smem` bytes of dynamic shared memory, cached per
// (kernel, device, smem): the occupancy query is host work we do not want on every call. Also
// raises the kernel's dynamic shared memory limit where `smem` needs it.
int blocks_per_sm(const void* kernel, int threads, int smem, const char* op);

// Sums part[n, prows, cols] over prows into outs[0..n) (n = 1 or 2), in one launch, in a fixed
// order; outs are float32, float16 or bfloat16.
void sum_partials(const at::Tensor& part, const std::vector<at::Tensor>& outs,
                  cudaStream_t stream);

// How a weight/bias pointer is read: absent, the LayerNorm input's dtype, or float32.
enum ParamKind : int { kParamNone = 0, kParamSame = 1, kParamFloat = 2 };

// How an RMSNorm scales its normalised row xhat = x * rstd (float32):
//   y = mid(xhat) * (w + offset), the product in float32, rounded once to the output dtype.
// mid rounds xhat to a half dtype first where the model casts before the weight (LLaMA casts to
// the input's dtype, T5 to a half weight's); offset is Gemma's (1 + w). rms_norm.h says which
// model computes which.
struct RmsForm {
  float offset = 0.f;
  int mid = 0;  // 0: none, 1: float16, 2: bfloat16
};

inline int param_kind(const std::optional<at::Tensor>& p, at::ScalarType input) {
  if (!p.has_value() || !p->defined()) return kParamNone;
  return p->scalar_type() == input ? kParamSame : kParamFloat;
}

inline const void* param_ptr(const std::optional<at::Tensor>& p) {
  return p.has_value() && p->defined() ? p->data_ptr() : nullptr;
}

namespace {

using cuda::load_floats;
using cuda::Moments;
using cuda::store_floats;
using cuda::vec_of;

constexpr int block_threads(int tpr) { return tpr < 128 ? 128 : tpr; }

// Elements per thread held in registers per row tensor (forward: the row at its Held width;
// backward: x and dy raw). Forward: the smallest threads-per-row that fits 32 registers of the
// row each. Backward: the smallest that fits two vectors each (ncu: DRAM throughput follows the
// rows in flight per SM, which registers limit; wider configurations spilled).
constexpr int kFwdHeldRegs = 32;
constexpr int kFwdMaxTpr = 1024;
constexpr int kBwdMaxTpr = 1024;

// Backward: two 16-byte vectors of x and of dy per thread, held raw (8 floats or 16 halves).
template <typename T>
constexpr int bwd_max_elems() {
  return 2 * vec_of<T>();
}

template <typename Src>
constexpr int fwd_max_elems() {
  return kFwdHeldRegs * 4 / static_cast<int>(sizeof(typename Src::Held));
}

// Vectors per thread at the widest TPR for a given budget, in {1, 2, 4, 8}.
constexpr int items_max(int vec, int max_elems) {
  const int n = max_elems / vec;
  return n >= 8 ? 8 : (n >= 4 ? 4 : (n >= 2 ? 2 : 1));
}

template <typename T, int VEC>
__device__ __forceinline__ void load_param(const void* p, int kind, int64_t off,
                                           float (&out)[VEC], float dflt) {
  if (kind == kParamSame) {
    load_floats<T, VEC>(static_cast<const T*>(p) + off, out);
  } else if (kind == kParamFloat) {
    load_floats<float, VEC>(static_cast<const float*>(p) + off, out);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = dflt;
  }
}

// RmsForm::mid's code of a 16-bit dtype.
template <typename T>
constexpr int mid_code() {
  return std::is_same_v<T, c10::Half> ? 1 : (std::is_same_v<T, c10::BFloat16> ? 2 : 0);
}

__device__ __forceinline__ float round_mid(float v, int mid) {
  if (mid == 1) return static_cast<float>(static_cast<c10::Half>(v));
  if (mid == 2) return static_cast<float>(static_cast<c10::BFloat16>(v));
  return v;
}

// y of one element: LayerNorm's xhat * w + b, or an RMSNorm's form.
template <bool RMS>
__device__ __forceinline__ float affine(float xhat, float w, float b, const RmsForm& form) {
  if constexpr (RMS) {
    // w itself where there is no offset: w + 0 would turn a -0 weight into +0 (native: w * h)
    return round_mid(xhat, form.mid) * (form.offset != 0.f ? w + form.offset : w);
  } else {
    return fmaf(xhat, w, b);
  }
}

template <typename T>
__device__ __forceinline__ float load_param_scalar(const void* p, int kind, int64_t j,
                                                   float dflt) {
  if (kind == kParamSame) return static_cast<float>(static_cast<const T*>(p)[j]);
  if (kind == kParamFloat) return static_cast<const float*>(p)[j];
  return dflt;
}

// ------------------------------------------------------------------------------------------
// LayerNorm's own policies: read x, write dx.

template <typename T>
struct PlainRows {
  using Param = T;
  using Held = T;
  static constexpr int kVec = vec_of<T>();
  // pick_config's items4_max_tpr (H200 sweep): a 16-bit row of 8192 runs 3-10% faster as 128
  // threads x 8 vectors than as 256 x 4 (LayerNorm, RMSNorm); a float32 row of 4096 3% slower.
  static constexpr int kItems4MaxTpr = sizeof(T) == 2 ? 128 : 256;
  const T* x;

  struct Row {
    const T* xr;
    __device__ __forceinline__ cuda::RawVec<T, kVec> load_raw(int vi) const {
      return cuda::load_raw<T, kVec>(xr + static_cast<int64_t>(vi) * kVec);
    }
    template <typename F>
    __device__ __forceinline__ void for_each(int cols, F&& f) const {
      for (int j = threadIdx.x; j < cols; j += blockDim.x) f(static_cast<float>(xr[j]));
    }
    __device__ __forceinline__ float reload(int j) const { return static_cast<float>(xr[j]); }
  };

  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Row row(int64_t row, int cols) const { return Row{x + row * cols}; }
};

template <typename T>
struct PlainSink {
  static constexpr int kVec = vec_of<T>();
  T* dx;  // null: dx not wanted

  struct Row {
    T* dxr;
    __device__ __forceinline__ void store(int vi, const float (&out)[kVec]) const {
      store_floats<T, kVec>(dxr + static_cast<int64_t>(vi) * kVec, out);
    }
    template <typename F>
    __device__ __forceinline__ void for_each(int cols, F&& f) const {
      for (int j = threadIdx.x; j < cols; j += blockDim.x) dxr[j] = static_cast<T>(f(j));
    }
  };

  __host__ __device__ __forceinline__ bool enabled() const { return dx != nullptr; }
  // No minimum of resident blocks in the launch bounds (0 emits none): LayerNorm's kernels
  // keep the register allocation they were tuned with.
  static constexpr int min_blocks(int /*threads*/) { return 0; }
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Row row(int64_t row, int cols) const { return Row{dx + row * cols}; }
};

// ------------------------------------------------------------------------------------------
// Fast path.

template <typename Src, typename O, int TPR, int ITEMS, bool RMS>
__global__ void __launch_bounds__(block_threads(TPR))
    ln_fwd_vec_kernel(Src src, const void* __restrict__ w, const void* __restrict__ b,
                      int w_kind, int b_kind, O* __restrict__ y, float* __restrict__ mean_out,
                      float* __restrict__ rstd_out, int64_t rows, int cols, float eps,
                      RmsForm form) {
  using P = typename Src::Param;
  using H = typename Src::Held;
  constexpr int VEC = Src::kVec;
  constexpr int THREADS = block_threads(TPR);
  constexpr int RPB = THREADS / TPR;  // rows per block
  constexpr int WPR = TPR / 32;       // warps per row
  const int lane = threadIdx.x % TPR;
  const int sub = threadIdx.x / TPR;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RPB + sub;
  const bool active = row < rows;
  const int nvec = cols / VEC;
  src.begin();
  const auto xr = src.row(row, cols);

  // The row at its storage width, unpacked exactly where used: half the registers of floats
  // for a 16-bit row (48 instead of 62 a thread at 4 vectors: 10 resident blocks of 128 per SM
  // instead of 8; H200, bf16 32768x4096: 180 against 190 us). cuda::opaque makes the compiler
  // unpack again after the reduction rather than keep the floats of the first unpacking live.
  cuda::RawVec<H, VEC> h[ITEMS];
  // The thread's values are summed shifted by its first one: a row of equal values then has
  // exactly that mean (an unshifted float sum of n copies of c divided by n is not always c,
  // and with a small eps rstd ~ 1/sqrt(eps) amplifies the difference: native's Welford mean
  // gives exactly 0 there). It also keeps precision for rows far from zero.
  float shift = 0.f;
  float sum = 0.f;
  int cnt = 0;
  // Every load first, then the shifted sum: with the sum in this loop each load sat in its
  // own branch behind the previous vector's sum (SASS: one 16-byte load in flight a thread),
  // where RMSNorm's loop issues all ITEMS loads back to back. Same sums in the same order.
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int vi = i * TPR + lane;
    if (active && vi < nvec) {
      h[i] = xr.load_raw(vi);
      cnt += VEC;
    }
  }
  if constexpr (!RMS) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (active && i * TPR + lane < nvec) {
        float v[VEC];
        cuda::unpack_floats_by_word<H, VEC>(cuda::opaque(h[i]), v);
        if (i == 0) shift = v[0];  // item 0 is the thread's first whenever it has any
#pragma unroll
        for (int k = 0; k < VEC; ++k) sum += v[k] - shift;
      }
    }
  }
  // RMSNorm: moments about 0 (m2 is the sum of squares; merging them adds no mean term)
  const float local_mean = !RMS && cnt > 0 ? shift + sum / cnt : 0.f;
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (active && i * TPR + lane < nvec) {
      float v[VEC];
      cuda::unpack_floats_by_word<H, VEC>(cuda::opaque(h[i]), v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = v[k] - local_mean;
        m2 = fmaf(d, d, m2);
      }
    }
  }
  Moments m = cuda::warp_merge_moments({static_cast<float>(cnt), local_mean, m2});
  if constexpr (WPR > 1) {
    __shared__ Moments warp_moments[THREADS / 32];
    if (threadIdx.x % 32 == 0) warp_moments[threadIdx.x / 32] = m;
    __syncthreads();
    m = warp_moments[sub * WPR];
#pragma unroll
    for (int k = 1; k < WPR; ++k) m = cuda::merge_moments(m, warp_moments[sub * WPR + k]);
  }
  if (!active) return;
  const float mean = RMS ? 0.f : m.mean;
  const float rstd = rsqrtf(m.m2 / cols + eps);
  if (lane == 0) {
    if constexpr (!RMS) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  O* yr = y + row * cols;
  // LLaMA's form (and T5's with a weight of the input's dtype) in one 16-bit dtype:
  // y = round_O(round_O(x * rstd) * w). The product of two
  // values of O is O's packed mul (cuda_utils.cuh: the same bits), on raw words. Not in the
  // kernels of over 4 vectors or 256 threads a row: there ptxas gave the two output passes
  // together 8-11 more registers a thread (fewer resident blocks).
  if constexpr (RMS && std::is_same_v<O, P> && std::is_same_v<O, H> && sizeof(O) == 2 &&
                ITEMS <= 4 && TPR <= 256) {
    if (w_kind == kParamSame && form.offset == 0.f && form.mid == mid_code<O>()) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int vi = i * TPR + lane;
        if (vi < nvec) {
          float v[VEC];
          cuda::unpack_floats_by_word<H, VEC>(cuda::opaque(h[i]), v);
          const auto wr = cuda::load_raw<P, VEC>(static_cast<const P*>(w) + vi * VEC);
          cuda::RawVec<O, VEC> out;
#pragma unroll
          for (int k = 0; k < VEC / 2; ++k) {
            const uint32_t xhat = cuda::pack2<O>(v[2 * k] * rstd, v[2 * k + 1] * rstd);
            cuda::words_of(out)[k] = cuda::mul2<O>(xhat, cuda::words_of(wr)[k]);
          }
          cuda::store_raw<O, VEC>(yr + static_cast<int64_t>(vi) * VEC, out);
        }
      }
      return;
    }
  }
  if constexpr (!RMS && std::is_same_v<H, c10::BFloat16> && std::is_same_v<P, H>) {
    // A bfloat16 weight and bias (every bf16 model's LayerNorm): both loads of a vector issued
    // together, from pointers built once (the kind dispatch below rebuilt each address and
    // waited for the weight's load before issuing the bias's). The same arithmetic. Not for
    // float16 or float32 rows: ptxas gave those kernels 2-16 more registers with it (sm_90a).
    if (w_kind == kParamSame && b_kind == kParamSame) {
      // The thread's offset through an empty asm: the compiler would otherwise hoist these
      // pointers above the branch for the generic loop too, live across the reduction
      // (48 -> 55 registers).
      int first = lane * VEC;
      asm volatile("" : "+r"(first));
      const P* wt = static_cast<const P*>(w) + first;
      const P* bt = static_cast<const P*>(b) + first;
      O* yt = yr + first;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (i * TPR + lane < nvec) {
          const auto wr = cuda::load_raw<P, VEC>(wt + i * TPR * VEC);
          const auto br = cuda::load_raw<P, VEC>(bt + i * TPR * VEC);
          float v[VEC], wv[VEC], bv[VEC], out[VEC];
          cuda::unpack_floats_by_word<H, VEC>(cuda::opaque(h[i]), v);
          cuda::unpack_floats_by_word<P, VEC>(wr, wv);
          cuda::unpack_floats_by_word<P, VEC>(br, bv);
#pragma unroll
          for (int k = 0; k < VEC; ++k) out[k] = fmaf((v[k] - mean) * rstd, wv[k], bv[k]);
          store_floats<O, VEC>(yt + i * TPR * VEC, out);
        }
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int vi = i * TPR + lane;
    if (vi < nvec) {
      float v[VEC], wv[VEC], bv[VEC], out[VEC];
      cuda::unpack_floats_by_word<H, VEC>(cuda::opaque(h[i]), v);
      load_param<P, VEC>(w, w_kind, static_cast<int64_t>(vi) * VEC, wv, 1.f);
      load_param<P, VEC>(b, b_kind, static_cast<int64_t>(vi) * VEC, bv, 0.f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = affine<RMS>((v[k] - mean) * rstd, wv[k], bv[k], form);
      store_floats<O, VEC>(yr + static_cast<int64_t>(vi) * VEC, out);
    }
  }
}

// Persistent backward: block b handles row groups b, b + gridDim.x, ...; hands dx to the sink
// and writes one partial row of dweight and dbias sums (dw_part / db_part may be null). x is the
// LayerNorm input (dtype T, also the dtype of a kParamSame weight). The partial sums live in
// shared memory, [2][RPB][cols] floats, each element owned by one thread (no atomics), in
// float4 slots laid out so that a warp's 16-byte accesses fall in distinct banks; this keeps
// registers for the rows in flight. An RMSNorm (no bias) keeps [1][RPB][cols]: the dbias sums
// it used to update for every row cost registers too (H200, bf16: 78 -> 64 a thread at 512 x 2,
// 2 blocks of 512 per SM instead of 1; docs/decisions.md).
template <typename T, typename G, typename Sink, int TPR, int ITEMS, bool RMS>
__global__ void __launch_bounds__(block_threads(TPR), Sink::min_blocks(block_threads(TPR)))
    ln_bwd_vec_kernel(const G* __restrict__ dy, const T* __restrict__ x,
                      const float* __restrict__ mean, const float* __restrict__ rstd,
                      const void* __restrict__ w, int w_kind, Sink sink,
                      float* __restrict__ dw_part, float* __restrict__ db_part, int64_t rows,
                      int cols, RmsForm form) {
  constexpr int VEC = Sink::kVec;
  static_assert(VEC % vec_of<T>() == 0 && VEC % vec_of<G>() == 0, "vector of whole 16 bytes");
  constexpr int THREADS = block_threads(TPR);
  constexpr int RPB = THREADS / TPR;
  constexpr int WPR = TPR / 32;
  extern __shared__ float param_sums[];
  const int lane = threadIdx.x % TPR;
  const int sub = threadIdx.x / TPR;
  const int nvec = cols / VEC;
  const float inv_cols = 1.f / static_cast<float>(cols);
  const bool want_params = dw_part != nullptr || db_part != nullptr;
  float* dw_sums = param_sums + static_cast<int64_t>(sub) * cols;
  float* db_sums = param_sums + static_cast<int64_t>(RPB + sub) * cols;  // LayerNorm only
  sink.begin();
  // Element k of vector vi lives at float4 slot (k / 4) * nvec + vi, lane k % 4.
  auto slot = [nvec](float* base, int vi, int c) {
    return reinterpret_cast<float4*>(base) + c * nvec + vi;
  };
  if (want_params) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int vi = i * TPR + lane;
      if (vi < nvec) {
#pragma unroll
        for (int c = 0; c < VEC / 4; ++c) {
          if constexpr (RMS)
            *slot(dw_sums, vi, c) = make_float4(0.f, 0.f, 0.f, 0.f);
          else
            *slot(dw_sums, vi, c) = *slot(db_sums, vi, c) = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    }
  }

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB; base < rows;
       base += static_cast<int64_t>(gridDim.x) * RPB) {
    const int64_t row = base + sub;
    const bool active = row < rows;
    // The row stays in registers at its storage width; xhat and dy * weight are recomputed
    // in the dx pass instead of held as floats (twice the registers for bf16/fp16).
    cuda::RawVec<T, VEC> x_raw[ITEMS];
    cuda::RawVec<G, VEC> dy_raw[ITEMS];
    const float mu = active && !RMS ? mean[row] : 0.f;
    const float rs = active ? rstd[row] : 0.f;
    float s_g = 0.f, s_gx = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int vi = i * TPR + lane;
      if (active && vi < nvec) {
        x_raw[i] = cuda::load_raw<T, VEC>(x + row * cols + static_cast<int64_t>(vi) * VEC);
        dy_raw[i] = cuda::load_raw<G, VEC>(dy + row * cols + static_cast<int64_t>(vi) * VEC);
      }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int vi = i * TPR + lane;
      if (active && vi < nvec) {
        float xh[VEC], g[VEC], wv[VEC];
        cuda::unpack_floats<T, VEC>(x_raw[i], xh);
        cuda::unpack_floats<G, VEC>(dy_raw[i], g);
        load_param<T, VEC>(w, w_kind, static_cast<int64_t>(vi) * VEC, wv, 1.f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) xh[k] = (xh[k] - mu) * rs;
        if (want_params) {
          // dweight sums dy * what the weight multiplied: an RMSNorm's mid-rounded xhat
          float xm[VEC];
#pragma unroll
          for (int k = 0; k < VEC; ++k) xm[k] = RMS ? round_mid(xh[k], form.mid) : xh[k];
#pragma unroll
          for (int c = 0; c < VEC / 4; ++c) {
            // (an RMSNorm has no bias: no dbias sums)
            float4 dw4 = *slot(dw_sums, vi, c), db4;
            if constexpr (!RMS) db4 = *slot(db_sums, vi, c);
            const float* gc = &g[4 * c];
            const float* xc = &xm[4 * c];
            dw4 = make_float4(fmaf(gc[0], xc[0], dw4.x), fmaf(gc[1], xc[1], dw4.y),
                              fmaf(gc[2], xc[2], dw4.z), fmaf(gc[3], xc[3], dw4.w));
            if constexpr (!RMS)
              db4 = make_float4(db4.x + gc[0], db4.y + gc[1], db4.z + gc[2], db4.w + gc[3]);
            *slot(dw_sums, vi, c) = dw4;
            if constexpr (!RMS) *slot(db_sums, vi, c) = db4;
          }
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float gw = g[k] * (RMS ? wv[k] + form.offset : wv[k]);
          s_g += gw;
          s_gx = fmaf(gw, xh[k], s_gx);
        }
      }
    }
    s_g = cuda::warp_sum(s_g);
    s_gx = cuda::warp_sum(s_gx);
    if constexpr (WPR > 1) {
      __shared__ float warp_sums[THREADS / 32][2];
      if (threadIdx.x % 32 == 0) {
        warp_sums[threadIdx.x / 32][0] = s_g;
        warp_sums[threadIdx.x / 32][1] = s_gx;
      }
      __syncthreads();
      s_g = warp_sums[sub * WPR][0];
      s_gx = warp_sums[sub * WPR][1];
#pragma unroll
      for (int k = 1; k < WPR; ++k) {
        s_g += warp_sums[sub * WPR + k][0];
        s_gx += warp_sums[sub * WPR + k][1];
      }
      __syncthreads();  // warp_sums is rewritten in the next iteration
    }
    if (active && sink.enabled()) {
      const float c1 = s_gx * inv_cols, c2 = RMS ? 0.f : s_g * inv_cols;
      const auto dxr = sink.row(row, cols);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int vi = i * TPR + lane;
        if (vi < nvec) {
          float xh[VEC], g[VEC], wv[VEC], out[VEC];
          cuda::unpack_floats<T, VEC>(x_raw[i], xh);
          cuda::unpack_floats<G, VEC>(dy_raw[i], g);
          load_param<T, VEC>(w, w_kind, static_cast<int64_t>(vi) * VEC, wv, 1.f);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float gw = g[k] * (RMS ? wv[k] + form.offset : wv[k]);
            out[k] = rs * (gw - (xh[k] - mu) * rs * c1 - c2);
          }
          dxr.store(vi, out);
        }
      }
    }
  }

  if (!want_params) return;
  __syncthreads();
  // Fold the block's row groups in group order and write the block's partial row.
  const int64_t prow = static_cast<int64_t>(blockIdx.x) * cols;
  for (int e = threadIdx.x; e < cols; e += THREADS) {
    const int j = ((e % VEC) / 4 * nvec + e / VEC) * 4 + e % 4;
    float dw = param_sums[j], db = RMS ? 0.f : param_sums[static_cast<int64_t>(RPB) * cols + j];
#pragma unroll
    for (int r = 1; r < RPB; ++r) {
      dw += param_sums[static_cast<int64_t>(r) * cols + j];
      if constexpr (!RMS) db += param_sums[static_cast<int64_t>(RPB + r) * cols + j];
    }
    if (dw_part) dw_part[prow + e] = dw;
    if (!RMS && db_part) db_part[prow + e] = db;
  }
}

// ------------------------------------------------------------------------------------------
// Generic path.

constexpr int kGenericThreads = 512;

// Merges per-thread moments over the whole block; every thread gets the identical result.
__device__ __forceinline__ Moments block_merge_moments(Moments m) {
  __shared__ Moments warp_moments[kGenericThreads / 32];
  m = cuda::warp_merge_moments(m);
  if (threadIdx.x % 32 == 0) warp_moments[threadIdx.x / 32] = m;
  __syncthreads();
  m = warp_moments[0];
  for (int k = 1; k < static_cast<int>(blockDim.x / 32); ++k)
    m = cuda::merge_moments(m, warp_moments[k]);
  return m;
}

__device__ __forceinline__ float block_sum(float v, float* scratch /* [32] */) {
  v = cuda::warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int k = 1; k < static_cast<int>(blockDim.x / 32); ++k) v += scratch[k];
  return v;
}

template <typename Src, typename O, bool RMS>
__global__ void __launch_bounds__(kGenericThreads)
    ln_fwd_generic_kernel(Src src, const void* __restrict__ w, const void* __restrict__ b,
                          int w_kind, int b_kind, O* __restrict__ y,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out, int cols,
                          float eps, RmsForm form) {
  using P = typename Src::Param;
  const int64_t row = blockIdx.x;
  src.begin();
  const auto xr = src.row(row, cols);
  Moments m{0.f, 0.f, 0.f};  // Welford per thread
  xr.for_each(cols, [&](float v) {
    m.n += 1.f;
    if constexpr (RMS) {  // moments about 0
      m.m2 = fmaf(v, v, m.m2);
    } else {
      const float d = v - m.mean;
      m.mean += d / m.n;
      m.m2 = fmaf(d, v - m.mean, m.m2);
    }
  });
  m = block_merge_moments(m);
  const float mean = m.mean;
  const float rstd = rsqrtf(m.m2 / cols + eps);
  if (threadIdx.x == 0) {
    if constexpr (!RMS) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  O* yr = y + row * cols;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xhat = (xr.reload(j) - mean) * rstd;
    yr[j] = static_cast<O>(affine<RMS>(xhat, load_param_scalar<P>(w, w_kind, j, 1.f),
                                       load_param_scalar<P>(b, b_kind, j, 0.f), form));
  }
}

template <typename T, typename G, typename Sink, bool RMS>
__global__ void __launch_bounds__(kGenericThreads)
    ln_bwd_dx_generic_kernel(const G* __restrict__ dy, const T* __restrict__ x,
                             const float* __restrict__ mean, const float* __restrict__ rstd,
                             const void* __restrict__ w, int w_kind, Sink sink, int cols,
                             RmsForm form) {
  __shared__ float scratch[2][32];
  const int64_t row = blockIdx.x;
  sink.begin();
  const T* xr = x + row * cols;
  const G* gr = dy + row * cols;
  const float mu = RMS ? 0.f : mean[row], rs = rstd[row];
  const float offset = RMS ? form.offset : 0.f;
  float s_g = 0.f, s_gx = 0.f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g =
        static_cast<float>(gr[j]) * (load_param_scalar<T>(w, w_kind, j, 1.f) + offset);
    s_g += g;
    s_gx = fmaf(g, (static_cast<float>(xr[j]) - mu) * rs, s_gx);
  }
  s_g = block_sum(s_g, scratch[0]);
  s_gx = block_sum(s_gx, scratch[1]);
  const float c1 = s_gx / cols, c2 = RMS ? 0.f : s_g / cols;
  sink.row(row, cols).for_each(cols, [&](int j) {
    const float xhat = (static_cast<float>(xr[j]) - mu) * rs;
    const float g =
        static_cast<float>(gr[j]) * (load_param_scalar<T>(w, w_kind, j, 1.f) + offset);
    return rs * (g - xhat * c1 - c2);
  });
}

constexpr int kColTile = 32;
constexpr int kColSlices = 8;

// Partial dweight/dbias sums: block (x, y) covers 32 columns and row chunk y; slice ty sums
// rows ty, ty + 8, ... of the chunk into partial row y * 8 + ty.
template <typename T, typename G, bool RMS>
__global__ void ln_bwd_param_generic_kernel(const G* __restrict__ dy, const T* __restrict__ x,
                                            const float* __restrict__ mean,
                                            const float* __restrict__ rstd,
                                            float* __restrict__ dw_part,
                                            float* __restrict__ db_part, int64_t rows, int cols,
                                            int64_t rows_per_chunk, RmsForm form) {
  const int col = blockIdx.x * kColTile + threadIdx.x;
  if (col >= cols) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = std::min(rows, begin + rows_per_chunk);
  float dw = 0.f, db = 0.f;
  for (int64_t r = begin + threadIdx.y; r < end; r += kColSlices) {
    const float g = static_cast<float>(dy[r * cols + col]);
    if constexpr (RMS) {
      dw = fmaf(g, round_mid(static_cast<float>(x[r * cols + col]) * rstd[r], form.mid), dw);
    } else {
      dw = fmaf(g, (static_cast<float>(x[r * cols + col]) - mean[r]) * rstd[r], dw);
    }
    db += g;
  }
  const int64_t prow = (static_cast<int64_t>(blockIdx.y) * kColSlices + threadIdx.y) * cols;
  if (dw_part) dw_part[prow + col] = dw;
  if (db_part) db_part[prow + col] = db;
}

// ------------------------------------------------------------------------------------------
// Host launchers.

// Calls f(TPR, ITEMS) as integral constants for the configurations pick_config can return
// (FWD: the forward's set).
template <int IMAX, int MAX_TPR, bool FWD, typename F>
void with_config(VecConfig c, const char* op, F&& f) {
  auto go = [&](auto tpr_c, auto items_c) {
    constexpr int kTpr = decltype(tpr_c)::value;
    constexpr int kItems = decltype(items_c)::value;
    if constexpr (kTpr <= MAX_TPR && kItems <= IMAX && has_vec_kernel(kTpr, kItems, FWD)) {
      f(tpr_c, items_c);
    } else {
      TORCH_CHECK(false, op, ": internal error: no kernel for tpr=", std::to_string(c.tpr),
                  " items=", std::to_string(c.items));
    }
  };
  auto by_items = [&](auto tpr_c) {
    switch (c.items) {
      case 1: return go(tpr_c, std::integral_constant<int, 1>{});
      case 2: return go(tpr_c, std::integral_constant<int, 2>{});
      case 4: return go(tpr_c, std::integral_constant<int, 4>{});
      default: return go(tpr_c, std::integral_constant<int, 8>{});
    }
  };
  switch (c.tpr) {
    case 32: return by_items(std::integral_constant<int, 32>{});
    case 64: return by_items(std::integral_constant<int, 64>{});
    case 128: return by_items(std::integral_constant<int, 128>{});
    case 256: return by_items(std::integral_constant<int, 256>{});
    case 512: return by_items(std::integral_constant<int, 512>{});
    default: return by_items(std::integral_constant<int, 1024>{});
  }
}

// The forward's fast-path configuration for rows of `cols` from source Src (none: the generic
// path). `aligned`: every pointer the kernel reads or writes in vectors is 16-byte aligned.
// `items4_max_tpr`: pick_config's, where an op sharing Src tunes it otherwise (0: Src's).
template <typename Src>
std::optional<VecConfig> fwd_vec_config(int64_t cols, bool aligned, const char* env_tpr,
                                        int items4_max_tpr = 0) {
  return aligned ? pick_config(cols, Src::kVec, fwd_max_elems<Src>(), kFwdMaxTpr, env_tpr,
                               items4_max_tpr > 0 ? items4_max_tpr : Src::kItems4MaxTpr,
                               /*fwd=*/true)
                 : std::nullopt;
}

// Forward over `rows` rows of `cols` from `src`: y (dtype O), mean, rstd. cfg from
// fwd_vec_config (none: the generic kernel, block per row).
// RMS: an RMSNorm of `form` (mean and bp unused).
template <typename O, typename Src, bool RMS = false>
void launch_fwd(const Src& src, const std::optional<VecConfig>& cfg, const void* wp,
                const void* bp, int wk, int bk, O* y, float* mean, float* rstd, int64_t rows,
                int cols, float eps, const char* op, cudaStream_t stream,
                RmsForm form = {}) {
  if (cfg) {
    constexpr int kImax = items_max(Src::kVec, fwd_max_elems<Src>());
    with_config<kImax, kFwdMaxTpr, true>(*cfg, op, [&](auto tpr_c, auto items_c) {
      constexpr int kTpr = decltype(tpr_c)::value;
      constexpr int kRpb = block_threads(kTpr) / kTpr;
      const int64_t blocks = (rows + kRpb - 1) / kRpb;
      ln_fwd_vec_kernel<Src, O, kTpr, decltype(items_c)::value, RMS>
          <<<blocks, block_threads(kTpr), 0, stream>>>(src, wp, bp, wk, bk, y, mean, rstd, rows,
                                                       cols, eps, form);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    ln_fwd_generic_kernel<Src, O, RMS><<<rows, kGenericThreads, 0, stream>>>(
        src, wp, bp, wk, bk, y, mean, rstd, cols, eps, form);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Backward over `rows` rows of `cols`: dx to `sink` (when sink.enabled()), dweight into dw and
// dbias into db (undefined tensors: not wanted). x is the LayerNorm input (dtype T), dy its
// output's gradient (dtype G). `aligned`: every pointer read or written in vectors is 16-byte
// aligned (x, dy, the weight and the sink's).
// RMS: an RMSNorm of `form` (mean unused; db must be undefined: no dbias sums are kept).
template <typename T, typename G, typename Sink, bool RMS = false>
void launch_bwd(const G* dy, const T* x, const float* mean, const float* rstd, const void* wp,
                int wk, const Sink& sink, bool aligned, const at::Tensor& dw,
                const at::Tensor& db, int64_t rows, int cols, const at::TensorOptions& fopts,
                const char* env_tpr, const char* op, cudaStream_t stream,
                RmsForm form = {}) {
  const bool want_dw = dw.defined(), want_db = db.defined();
  // the RMS kernels keep no dbias sums (ln_bwd_vec_kernel)
  TORCH_CHECK(!(RMS && want_db), op, ": internal error: an RMSNorm has no dbias");
  constexpr int kVec = Sink::kVec;
  constexpr int kMaxElems = std::max(bwd_max_elems<T>(), kVec);
  // Partial sums, [dweight?, dbias?][partial rows][cols], one buffer.
  const int n_params = int{want_dw} + int{want_db};
  at::Tensor part;
  float* dw_part = nullptr;
  float* db_part = nullptr;
  auto alloc_partials = [&](int64_t prows) {
    if (n_params == 0) return;
    part = at::empty({n_params, prows, int64_t{cols}}, fopts);
    dw_part = want_dw ? part.data_ptr<float>() : nullptr;
    db_part = want_db ? part.data_ptr<float>() + (want_dw ? prows * cols : 0) : nullptr;
  };
  const auto cfg =
      aligned ? pick_config(cols, kVec, kMaxElems, kBwdMaxTpr, env_tpr) : std::nullopt;
  if (cfg) {
    constexpr int kImax = items_max(kVec, kMaxElems);
    with_config<kImax, kBwdMaxTpr, false>(*cfg, op, [&](auto tpr_c, auto items_c) {
      constexpr int kTpr = decltype(tpr_c)::value;
      constexpr int kThreads = block_threads(kTpr);
      constexpr int kRpb = kThreads / kTpr;
      const int smem = want_dw || want_db
                           ? (RMS ? 1 : 2) * kRpb * cols * static_cast<int>(sizeof(float))
                           : 0;
      const int64_t groups = (rows + kRpb - 1) / kRpb;
      auto kernel = ln_bwd_vec_kernel<T, G, Sink, kTpr, decltype(items_c)::value, RMS>;
      const int64_t blocks = std::min<int64_t>(
          groups, int64_t{sm_count()} *
                      blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem, op));
      alloc_partials(blocks);
      kernel<<<blocks, kThreads, smem, stream>>>(dy, x, mean, rstd, wp, wk, sink, dw_part,
                                                 db_part, rows, cols, form);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    if (sink.enabled()) {
      ln_bwd_dx_generic_kernel<T, G, Sink, RMS><<<rows, kGenericThreads, 0, stream>>>(
          dy, x, mean, rstd, wp, wk, sink, cols, form);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (want_dw || want_db) {
      // Row chunks: enough blocks to fill the GPU, partial buffers kept under ~64 MB.
      const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
      int64_t chunks = std::max<int64_t>(1, (int64_t{sm_count()} * 8 + col_tiles - 1) / col_tiles);
      chunks = std::min<int64_t>(chunks, (rows + kColSlices - 1) / kColSlices);
      chunks = std::max<int64_t>(
          1, std::min<int64_t>(chunks, (int64_t{64} << 20) / (2 * 4 * kColSlices * int64_t{cols})));
      chunks = std::min<int64_t>(chunks, 65535);
      const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
      chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
      alloc_partials(chunks * kColSlices);
      const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(chunks));
      ln_bwd_param_generic_kernel<T, G, RMS><<<grid, dim3(kColTile, kColSlices), 0, stream>>>(
          dy, x, mean, rstd, dw_part, db_part, rows, cols, rows_per_chunk, form);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (want_dw && want_db) {
    sum_partials(part, {dw, db}, stream);
  } else if (n_params == 1) {
    sum_partials(part, {want_dw ? dw : db}, stream);
  }
}

}  // namespace
}  // namespace ln
}  // namespace fastlayers
