// LayerNorm CUDA kernels.
//
// Fast path (cols a multiple of the 16-byte vector, 16-byte aligned pointers, row fits in
// registers): a row is held in registers by TPR threads (TPR = 32 .. 1024), each holding ITEMS
// 16-byte vectors, so x is read from memory once. Mean and variance come from one merged
// reduction of per-thread (count, mean, M2): exact two-pass numerics, one reduction round.
// Backward runs on a persistent grid; each block keeps its columns' dweight/dbias sums in
// registers over its rows and writes one partial row; a second kernel sums the partial rows
// in a fixed order. No atomics: gradients are bit-identical run to run.
//
// Generic path (any width or alignment, rows too wide for registers): block per row with
// strided scalar loops, and a column kernel for dweight/dbias partials.
//
// float64 inputs take simple double-precision kernels instead (layer_norm_cuda_f64.cu).
#include <ATen/cuda/CUDAContext.h>
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

#include "arch_check.h"
#include "common.h"
#include "cuda_utils.cuh"
#include "layer_norm.h"

namespace fastlayers {
namespace {

using cuda::load_floats;
using cuda::Moments;
using cuda::store_floats;

constexpr const char* kOp = "fastlayers.layer_norm";

// How a weight/bias pointer is read: absent, the input's dtype, or float32.
enum ParamKind : int { kParamNone = 0, kParamSame = 1, kParamFloat = 2 };

constexpr int block_threads(int tpr) { return tpr < 128 ? 128 : tpr; }

// Elements per thread held in registers per row tensor (forward: x as floats; backward: x
// and dy raw). Forward: the smallest threads-per-row that fits 32 elements each. Backward: the
// smallest that fits two vectors each (ncu: DRAM throughput follows the rows in flight per SM,
// which registers limit; wider configurations spilled).
constexpr int kFwdMaxElems = 32;
constexpr int kFwdMaxTpr = 1024;
constexpr int kBwdMaxTpr = 1024;

using cuda::vec_of;

// Backward: two 16-byte vectors of x and of dy per thread, held raw (8 floats or 16 halves).
template <typename T>
constexpr int bwd_max_elems() {
  return 2 * vec_of<T>();
}

// Vectors per thread at the widest TPR for a given budget, in {1, 2, 4}.
constexpr int items_max(int vec, int max_elems) {
  return max_elems / vec >= 4 ? 4 : (max_elems / vec >= 2 ? 2 : 1);
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

template <typename T>
__device__ __forceinline__ float load_param_scalar(const void* p, int kind, int64_t j,
                                                   float dflt) {
  if (kind == kParamSame) return static_cast<float>(static_cast<const T*>(p)[j]);
  if (kind == kParamFloat) return static_cast<const float*>(p)[j];
  return dflt;
}

// ------------------------------------------------------------------------------------------
// Fast path.

template <typename T, typename O, int TPR, int ITEMS>
__global__ void __launch_bounds__(block_threads(TPR))
    ln_fwd_vec_kernel(const T* __restrict__ x, const void* __restrict__ w,
                      const void* __restrict__ b, int w_kind, int b_kind, O* __restrict__ y,
                      float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                      int cols, float eps) {
  constexpr int VEC = vec_of<T>();
  constexpr int THREADS = block_threads(TPR);
  constexpr int RPB = THREADS / TPR;  // rows per block
  constexpr int WPR = TPR / 32;       // warps per row
  const int lane = threadIdx.x % TPR;
  const int sub = threadIdx.x / TPR;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RPB + sub;
  const bool active = row < rows;
  const int nvec = cols / VEC;
  const T* xr = x + row * cols;

  float v[ITEMS][VEC];
  // The thread's values are summed shifted by its first one: a row of equal values then has
  // exactly that mean (an unshifted float sum of n copies of c divided by n is not always c,
  // and with a small eps rstd ~ 1/sqrt(eps) amplifies the difference: native's Welford mean
  // gives exactly 0 there). It also keeps precision for rows far from zero.
  float shift = 0.f;
  float sum = 0.f;
  int cnt = 0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int vi = i * TPR + lane;
    if (active && vi < nvec) {
      load_floats<T, VEC>(xr + static_cast<int64_t>(vi) * VEC, v[i]);
      if (cnt == 0) shift = v[i][0];
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum += v[i][k] - shift;
      cnt += VEC;
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[i][k] = 0.f;
    }
  }
  const float local_mean = cnt > 0 ? shift + sum / cnt : 0.f;
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (active && i * TPR + lane < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = v[i][k] - local_mean;
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
  const float mean = m.mean;
  const float rstd = rsqrtf(m.m2 / cols + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  O* yr = y + row * cols;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int vi = i * TPR + lane;
    if (vi < nvec) {
      float wv[VEC], bv[VEC], out[VEC];
      load_param<T, VEC>(w, w_kind, static_cast<int64_t>(vi) * VEC, wv, 1.f);
      load_param<T, VEC>(b, b_kind, static_cast<int64_t>(vi) * VEC, bv, 0.f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = fmaf((v[i][k] - mean) * rstd, wv[k], bv[k]);
      store_floats<O, VEC>(yr + static_cast<int64_t>(vi) * VEC, out);
    }
  }
}

// Persistent backward: block b handles row groups b, b + gridDim.x, ...; writes dx and one
// partial row of dweight and dbias sums (dw_part / db_part may be null). The partial sums live
// in shared memory, [2][RPB][cols] floats, each element owned by one thread (no atomics), in
// float4 slots laid out so that a warp's 16-byte accesses fall in distinct banks; this keeps
// registers for the rows in flight.
template <typename T, typename G, int TPR, int ITEMS>
__global__ void __launch_bounds__(block_threads(TPR))
    ln_bwd_vec_kernel(const G* __restrict__ dy, const T* __restrict__ x,
                      const float* __restrict__ mean, const float* __restrict__ rstd,
                      const void* __restrict__ w, int w_kind, T* __restrict__ dx,
                      float* __restrict__ dw_part, float* __restrict__ db_part, int64_t rows,
                      int cols) {
  constexpr int VEC = vec_of<T>();
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
  float* db_sums = param_sums + static_cast<int64_t>(RPB + sub) * cols;
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
        for (int c = 0; c < VEC / 4; ++c)
          *slot(dw_sums, vi, c) = *slot(db_sums, vi, c) = make_float4(0.f, 0.f, 0.f, 0.f);
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
    const float mu = active ? mean[row] : 0.f;
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
#pragma unroll
          for (int c = 0; c < VEC / 4; ++c) {
            float4 dw4 = *slot(dw_sums, vi, c), db4 = *slot(db_sums, vi, c);
            const float* gc = &g[4 * c];
            const float* xc = &xh[4 * c];
            dw4 = make_float4(fmaf(gc[0], xc[0], dw4.x), fmaf(gc[1], xc[1], dw4.y),
                              fmaf(gc[2], xc[2], dw4.z), fmaf(gc[3], xc[3], dw4.w));
            db4 = make_float4(db4.x + gc[0], db4.y + gc[1], db4.z + gc[2], db4.w + gc[3]);
            *slot(dw_sums, vi, c) = dw4;
            *slot(db_sums, vi, c) = db4;
          }
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float gw = g[k] * wv[k];
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
    if (active && dx != nullptr) {
      const float c1 = s_gx * inv_cols, c2 = s_g * inv_cols;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int vi = i * TPR + lane;
        if (vi < nvec) {
          float xh[VEC], g[VEC], wv[VEC], out[VEC];
          cuda::unpack_floats<T, VEC>(x_raw[i], xh);
          cuda::unpack_floats<G, VEC>(dy_raw[i], g);
          load_param<T, VEC>(w, w_kind, static_cast<int64_t>(vi) * VEC, wv, 1.f);
#pragma unroll
          for (int k = 0; k < VEC; ++k)
            out[k] = rs * (g[k] * wv[k] - (xh[k] - mu) * rs * c1 - c2);
          store_floats<T, VEC>(dx + row * cols + static_cast<int64_t>(vi) * VEC, out);
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
    float dw = param_sums[j], db = param_sums[static_cast<int64_t>(RPB) * cols + j];
#pragma unroll
    for (int r = 1; r < RPB; ++r) {
      dw += param_sums[static_cast<int64_t>(r) * cols + j];
      db += param_sums[static_cast<int64_t>(RPB + r) * cols + j];
    }
    if (dw_part) dw_part[prow + e] = dw;
    if (db_part) db_part[prow + e] = db;
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

template <typename T, typename O>
__global__ void __launch_bounds__(kGenericThreads)
    ln_fwd_generic_kernel(const T* __restrict__ x, const void* __restrict__ w,
                          const void* __restrict__ b, int w_kind, int b_kind, O* __restrict__ y,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out, int cols,
                          float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  Moments m{0.f, 0.f, 0.f};  // Welford per thread
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = static_cast<float>(xr[j]);
    m.n += 1.f;
    const float d = v - m.mean;
    m.mean += d / m.n;
    m.m2 = fmaf(d, v - m.mean, m.m2);
  }
  m = block_merge_moments(m);
  const float mean = m.mean;
  const float rstd = rsqrtf(m.m2 / cols + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  O* yr = y + row * cols;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xhat = (static_cast<float>(xr[j]) - mean) * rstd;
    yr[j] = static_cast<O>(fmaf(xhat, load_param_scalar<T>(w, w_kind, j, 1.f),
                                load_param_scalar<T>(b, b_kind, j, 0.f)));
  }
}

template <typename T, typename G>
__global__ void __launch_bounds__(kGenericThreads)
    ln_bwd_dx_generic_kernel(const G* __restrict__ dy, const T* __restrict__ x,
                             const float* __restrict__ mean, const float* __restrict__ rstd,
                             const void* __restrict__ w, int w_kind, T* __restrict__ dx,
                             int cols) {
  __shared__ float scratch[2][32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const G* gr = dy + row * cols;
  const float mu = mean[row], rs = rstd[row];
  float s_g = 0.f, s_gx = 0.f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float g = static_cast<float>(gr[j]) * load_param_scalar<T>(w, w_kind, j, 1.f);
    s_g += g;
    s_gx = fmaf(g, (static_cast<float>(xr[j]) - mu) * rs, s_gx);
  }
  s_g = block_sum(s_g, scratch[0]);
  s_gx = block_sum(s_gx, scratch[1]);
  const float c1 = s_gx / cols, c2 = s_g / cols;
  T* dxr = dx + row * cols;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const float xhat = (static_cast<float>(xr[j]) - mu) * rs;
    const float g = static_cast<float>(gr[j]) * load_param_scalar<T>(w, w_kind, j, 1.f);
    dxr[j] = static_cast<T>(rs * (g - xhat * c1 - c2));
  }
}

constexpr int kColTile = 32;
constexpr int kColSlices = 8;

// Partial dweight/dbias sums: block (x, y) covers 32 columns and row chunk y; slice ty sums
// rows ty, ty + 8, ... of the chunk into partial row y * 8 + ty.
template <typename T, typename G>
__global__ void ln_bwd_param_generic_kernel(const G* __restrict__ dy, const T* __restrict__ x,
                                            const float* __restrict__ mean,
                                            const float* __restrict__ rstd,
                                            float* __restrict__ dw_part,
                                            float* __restrict__ db_part, int64_t rows, int cols,
                                            int64_t rows_per_chunk) {
  const int col = blockIdx.x * kColTile + threadIdx.x;
  if (col >= cols) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = std::min(rows, begin + rows_per_chunk);
  float dw = 0.f, db = 0.f;
  for (int64_t r = begin + threadIdx.y; r < end; r += kColSlices) {
    const float g = static_cast<float>(dy[r * cols + col]);
    dw = fmaf(g, (static_cast<float>(x[r * cols + col]) - mean[r]) * rstd[r], dw);
    db += g;
  }
  const int64_t prow = (static_cast<int64_t>(blockIdx.y) * kColSlices + threadIdx.y) * cols;
  if (dw_part) dw_part[prow + col] = dw;
  if (db_part) db_part[prow + col] = db;
}

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

// out_y[c] = sum over p of part[y, p, c] for y = blockIdx.y (dweight, dbias): each of 64 slices
// sums its rows in order, then the slices are added in order. Deterministic.
__global__ void sum_partials_kernel(const float* __restrict__ part, int64_t prows, int cols,
                                    void* out0, int code0, void* out1, int code1) {
  __shared__ float sums[kSumSlices][kSumCols + 1];
  const float* p = part + blockIdx.y * prows * cols;
  const int col = blockIdx.x * kSumCols + threadIdx.x;
  float s = 0.f;
  if (col < cols)
    for (int64_t r = threadIdx.y; r < prows; r += kSumSlices) s += p[r * cols + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = sums[0][threadIdx.x];
    for (int k = 1; k < kSumSlices; ++k) t += sums[k][threadIdx.x];
    store_as(blockIdx.y == 0 ? out0 : out1, col, t, blockIdx.y == 0 ? code0 : code1);
  }
}

// ------------------------------------------------------------------------------------------
// Host side.

int param_kind(const std::optional<at::Tensor>& p, const at::Tensor& input) {
  if (!p.has_value() || !p->defined()) return kParamNone;
  return p->scalar_type() == input.scalar_type() ? kParamSame : kParamFloat;
}

const void* param_ptr(const std::optional<at::Tensor>& p) {
  return p.has_value() && p->defined() ? p->data_ptr() : nullptr;
}

using cuda::aligned16;

struct VecConfig {
  int tpr;
  int items;
};

// Smallest threads-per-row whose registers hold the row; none if it is too wide or the
// vector width does not divide it. `env_tpr` (a benchmarking knob, e.g.
// FASTLAYERS_LN_FWD_TPR=256) forces the threads per row where the row still fits.
std::optional<VecConfig> pick_config(int64_t cols, int vec, int max_elems, int max_tpr,
                                     const char* env_tpr) {
  if (cols % vec != 0) return std::nullopt;
  const int64_t nvec = cols / vec;
  const int imax = items_max(vec, max_elems);
  auto items_for = [&](int tpr) {
    const int64_t items = (nvec + tpr - 1) / tpr;
    return items <= 1 ? 1 : (items <= 2 ? 2 : 4);
  };
  if (const char* forced = std::getenv(env_tpr)) {
    const int tpr = std::atoi(forced);
    if ((tpr == 32 || tpr == 64 || tpr == 128 || tpr == 256 || tpr == 512 || tpr == 1024) &&
        tpr <= max_tpr && nvec <= static_cast<int64_t>(tpr) * imax)
      return VecConfig{tpr, items_for(tpr)};
  }
  for (int tpr = 32; tpr <= max_tpr; tpr *= 2) {
    if (nvec <= static_cast<int64_t>(tpr) * imax) return VecConfig{tpr, items_for(tpr)};
  }
  return std::nullopt;
}

// Calls f(TPR, ITEMS) as integral constants for the configurations pick_config can return.
template <int IMAX, int MAX_TPR, typename F>
void with_config(VecConfig c, F&& f) {
  auto go = [&](auto tpr_c, auto items_c) {
    constexpr int kTpr = decltype(tpr_c)::value;
    constexpr int kItems = decltype(items_c)::value;
    if constexpr (kTpr <= MAX_TPR && kItems <= IMAX) {
      f(tpr_c, items_c);
    } else {
      TORCH_CHECK(false, kOp, ": internal error: no kernel for tpr=", std::to_string(c.tpr),
                  " items=", std::to_string(c.items));
    }
  };
  auto by_items = [&](auto tpr_c) {
    switch (c.items) {
      case 1: return go(tpr_c, std::integral_constant<int, 1>{});
      case 2: return go(tpr_c, std::integral_constant<int, 2>{});
      default: return go(tpr_c, std::integral_constant<int, 4>{});
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

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Resident blocks per SM for a kernel with `smem` bytes of dynamic shared memory, cached per
// (kernel, device, smem): the occupancy query is host work we do not want on every call. Also
// raises the kernel's dynamic shared memory limit where `smem` needs it.
int blocks_per_sm(const void* kernel, int threads, int smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  const std::tuple<const void*, int, int> key{kernel, at::cuda::current_device(), smem};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int smem_limit = static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
  TORCH_CHECK(smem <= smem_limit, kOp, ": row too wide for shared memory (",
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

int dtype_code(at::ScalarType st) {
  return st == at::kFloat ? 0 : (st == at::kHalf ? 1 : 2);
}

// Sums part[n, prows, cols] over prows into outs[0..n) (n = 1 or 2), in one launch.
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
  const int wk = param_kind(w, x), bk = param_kind(b, x);
  const void* wp = param_ptr(w);
  const void* bp = param_ptr(b);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(wp) &&
                       aligned16(bp);
  dispatch_dtype(x.scalar_type(), kOp, [&](auto in_tag) {
    using T = typename decltype(in_tag)::type;
    dispatch_dtype(y.scalar_type(), kOp, [&](auto out_tag) {
      using O = typename decltype(out_tag)::type;
      if constexpr (std::is_same_v<O, T> || std::is_same_v<O, float>) {
        constexpr int kVec = vec_of<T>();
        const auto cfg = aligned ? pick_config(cols, kVec, kFwdMaxElems, kFwdMaxTpr, "FASTLAYERS_LN_FWD_TPR") : std::nullopt;
        if (cfg) {
          with_config<items_max(kVec, kFwdMaxElems), kFwdMaxTpr>(*cfg, [&](auto tpr_c, auto items_c) {
            constexpr int kTpr = decltype(tpr_c)::value;
            constexpr int kRpb = block_threads(kTpr) / kTpr;
            const int64_t blocks = (rc.rows + kRpb - 1) / kRpb;
            ln_fwd_vec_kernel<T, O, kTpr, decltype(items_c)::value>
                <<<blocks, block_threads(kTpr), 0, stream>>>(
                    x.data_ptr<T>(), wp, bp, wk, bk, y.data_ptr<O>(), mean.data_ptr<float>(),
                    rstd.data_ptr<float>(), rc.rows, cols, static_cast<float>(eps));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        } else {
          ln_fwd_generic_kernel<T, O><<<rc.rows, kGenericThreads, 0, stream>>>(
              x.data_ptr<T>(), wp, bp, wk, bk, y.data_ptr<O>(), mean.data_ptr<float>(),
              rstd.data_ptr<float>(), cols, static_cast<float>(eps));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
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
  const int wk = param_kind(w, x);
  const void* wp = param_ptr(w);
  const bool aligned = aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) &&
                       aligned16(dx.data_ptr()) && aligned16(wp);
  // Partial sums, [dweight?, dbias?][partial rows][cols], one buffer.
  const int n_params = int{want_dw} + int{want_db};
  at::Tensor part;
  float* dw_part = nullptr;
  float* db_part = nullptr;
  auto alloc_partials = [&](int64_t prows) {
    if (n_params == 0) return;
    part = at::empty({n_params, prows, rc.cols}, fopts);
    dw_part = want_dw ? part.data_ptr<float>() : nullptr;
    db_part = want_db ? part.data_ptr<float>() + (want_dw ? prows * rc.cols : 0) : nullptr;
  };
  dispatch_dtype(x.scalar_type(), kOp, [&](auto in_tag) {
    using T = typename decltype(in_tag)::type;
    dispatch_dtype(dy.scalar_type(), kOp, [&](auto g_tag) {
      using G = typename decltype(g_tag)::type;
      if constexpr (std::is_same_v<G, T> || std::is_same_v<G, float>) {
        constexpr int kVec = vec_of<T>();
        const auto cfg = aligned ? pick_config(cols, kVec, bwd_max_elems<T>(), kBwdMaxTpr,
                                               "FASTLAYERS_LN_BWD_TPR")
                                 : std::nullopt;
        T* dxp = output_mask[0] ? dx.data_ptr<T>() : nullptr;
        if (cfg) {
          with_config<items_max(kVec, bwd_max_elems<T>()), kBwdMaxTpr>(*cfg, [&](auto tpr_c, auto items_c) {
            constexpr int kTpr = decltype(tpr_c)::value;
            constexpr int kThreads = block_threads(kTpr);
            constexpr int kRpb = kThreads / kTpr;
            auto kernel = ln_bwd_vec_kernel<T, G, kTpr, decltype(items_c)::value>;
            const int smem = want_dw || want_db ? 2 * kRpb * cols * static_cast<int>(sizeof(float)) : 0;
            const int64_t groups = (rc.rows + kRpb - 1) / kRpb;
            const int64_t blocks = std::min<int64_t>(
                groups, int64_t{sm_count()} *
                            blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem));
            alloc_partials(blocks);
            kernel<<<blocks, kThreads, smem, stream>>>(
                dy.data_ptr<G>(), x.data_ptr<T>(), mean_c.data_ptr<float>(),
                rstd_c.data_ptr<float>(), wp, wk, dxp,
                dw_part, db_part, rc.rows, cols);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        } else {
          if (dxp) {
            ln_bwd_dx_generic_kernel<T, G><<<rc.rows, kGenericThreads, 0, stream>>>(
                dy.data_ptr<G>(), x.data_ptr<T>(), mean_c.data_ptr<float>(),
                rstd_c.data_ptr<float>(), wp, wk, dxp, cols);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
          if (want_dw || want_db) {
            // Row chunks: enough blocks to fill the GPU, partial buffers kept under ~64 MB.
            const int64_t col_tiles = (rc.cols + kColTile - 1) / kColTile;
            int64_t chunks = std::max<int64_t>(1, (int64_t{sm_count()} * 8 + col_tiles - 1) / col_tiles);
            chunks = std::min<int64_t>(chunks, (rc.rows + kColSlices - 1) / kColSlices);
            chunks = std::max<int64_t>(1, std::min<int64_t>(
                chunks, (int64_t{64} << 20) / (2 * 4 * kColSlices * rc.cols)));
            chunks = std::min<int64_t>(chunks, 65535);
            const int64_t rows_per_chunk = (rc.rows + chunks - 1) / chunks;
            chunks = (rc.rows + rows_per_chunk - 1) / rows_per_chunk;
            alloc_partials(chunks * kColSlices);
            const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(chunks));
            ln_bwd_param_generic_kernel<T, G><<<grid, dim3(kColTile, kColSlices), 0, stream>>>(
                dy.data_ptr<G>(), x.data_ptr<T>(), mean_c.data_ptr<float>(),
                rstd_c.data_ptr<float>(), dw_part, db_part, rc.rows, cols, rows_per_chunk);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
        }
      } else {
        TORCH_CHECK(false, kOp, ": grad_out must have the input's dtype or float32");
      }
    });
  });
  at::Tensor dw = want_dw ? at::empty(normalized_shape, weight->options()) : empty_grad();
  at::Tensor db = want_db ? at::empty(normalized_shape, bias->options()) : empty_grad();
  if (want_dw && want_db) {
    sum_partials(part, {dw, db}, stream);
  } else if (n_params == 1) {
    sum_partials(part, {want_dw ? dw : db}, stream);
  }
  return {dx, dw, db};
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
}

}  // namespace fastlayers
