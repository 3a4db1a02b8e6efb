// LayerNorm CUDA kernels for float64 inputs: float64 parameters, statistics and accumulation.
// Simple and correct rather than tuned (float64 serves checks such as gradcheck and float64
// models, not speed): one block per row with two passes over the row (mean, then the squared
// deviations), a per-column kernel for the dweight/dbias partial sums, and a fixed-order sum of
// the partial rows. No atomics: gradients are bit-identical run to run. layer_norm_cuda.cu checks
// the arguments, allocates the outputs and calls these for float64.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "common/cuda_utils.cuh"
#include "layer_norm/layer_norm.h"

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.layer_norm";
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Sum over the block; every thread gets the identical result (butterfly within warps, then the
// warps' sums in warp order). scratch: kWarps doubles, not in use by another call.
__device__ double block_sum_f64(double v, double* scratch) {
  v = cuda::warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  double s = scratch[0];
#pragma unroll
  for (int k = 1; k < kWarps; ++k) s += scratch[k];
  return s;
}

// w and b may be null.
__global__ void __launch_bounds__(kThreads)
    ln_fwd_f64_kernel(const double* __restrict__ x, const double* __restrict__ w,
                      const double* __restrict__ b, double* __restrict__ y,
                      double* __restrict__ mean_out, double* __restrict__ rstd_out, int64_t cols,
                      double eps) {
  __shared__ double scratch[2][kWarps];
  const int64_t row = blockIdx.x;
  const double* xr = x + row * cols;
  double s = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) s += xr[j];
  const double mean = block_sum_f64(s, scratch[0]) / static_cast<double>(cols);
  double m2 = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const double d = xr[j] - mean;
    m2 = fma(d, d, m2);
  }
  const double var = block_sum_f64(m2, scratch[1]) / static_cast<double>(cols);
  const double rstd = 1.0 / sqrt(var + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  double* yr = y + row * cols;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    double v = (xr[j] - mean) * rstd;
    if (w != nullptr) v *= w[j];
    if (b != nullptr) v += b[j];
    yr[j] = v;
  }
}

// dx = rstd * (g - xhat * mean(g * xhat) - mean(g)), g = dy * w (w may be null).
__global__ void __launch_bounds__(kThreads)
    ln_bwd_dx_f64_kernel(const double* __restrict__ dy, const double* __restrict__ x,
                         const double* __restrict__ mean, const double* __restrict__ rstd,
                         const double* __restrict__ w, double* __restrict__ dx, int64_t cols) {
  __shared__ double scratch[2][kWarps];
  const int64_t row = blockIdx.x;
  const double* xr = x + row * cols;
  const double* gr = dy + row * cols;
  const double mu = mean[row], rs = rstd[row];
  double s_g = 0.0, s_gx = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const double g = w != nullptr ? gr[j] * w[j] : gr[j];
    s_g += g;
    s_gx = fma(g, (xr[j] - mu) * rs, s_gx);
  }
  const double c1 = block_sum_f64(s_gx, scratch[0]) / static_cast<double>(cols);
  const double c2 = block_sum_f64(s_g, scratch[1]) / static_cast<double>(cols);
  double* dxr = dx + row * cols;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const double g = w != nullptr ? gr[j] * w[j] : gr[j];
    dxr[j] = rs * (g - (xr[j] - mu) * rs * c1 - c2);
  }
}

constexpr int kColTile = 32;
constexpr int kColSlices = 8;

// Partial dweight/dbias sums (either may be null): block (x, y) covers kColTile columns and row
// chunk y; slice ty sums rows ty, ty + kColSlices, ... of the chunk into partial row
// y * kColSlices + ty.
__global__ void ln_bwd_param_f64_kernel(const double* __restrict__ dy,
                                        const double* __restrict__ x,
                                        const double* __restrict__ mean,
                                        const double* __restrict__ rstd,
                                        double* __restrict__ dw_part,
                                        double* __restrict__ db_part, int64_t rows,
                                        int64_t cols, int64_t rows_per_chunk) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  if (col >= cols) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = min(rows, begin + rows_per_chunk);
  double dw = 0.0, db = 0.0;
  for (int64_t r = begin + threadIdx.y; r < end; r += kColSlices) {
    const double g = dy[r * cols + col];
    dw = fma(g, (x[r * cols + col] - mean[r]) * rstd[r], dw);
    db += g;
  }
  const int64_t prow = (static_cast<int64_t>(blockIdx.y) * kColSlices + threadIdx.y) * cols;
  if (dw_part != nullptr) dw_part[prow + col] = dw;
  if (db_part != nullptr) db_part[prow + col] = db;
}

// out[c] = sum over p of part[p, c], p in order.
__global__ void sum_rows_f64_kernel(const double* __restrict__ part, int64_t prows, int64_t cols,
                                    double* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  double s = 0.0;
  for (int64_t p = 0; p < prows; ++p) s += part[p * cols + col];
  out[col] = s;
}

const double* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<double>() : nullptr;
}

void check_rows(int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), kOp,
              ": float64 inputs take at most 2^31 - 1 rows");
}

}  // namespace

void layer_norm_fwd_cuda_f64(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                             double eps, const at::Tensor& y, const at::Tensor& mean,
                             const at::Tensor& rstd, int64_t rows, int64_t cols) {
  check_rows(rows);
  ln_fwd_f64_kernel<<<static_cast<unsigned>(rows), kThreads, 0,
                      at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<double>(), ptr_or_null(w), ptr_or_null(b), y.data_ptr<double>(),
      mean.data_ptr<double>(), rstd.data_ptr<double>(), cols, eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void layer_norm_bwd_cuda_f64(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                             const at::Tensor& rstd, const at::Tensor& w, const at::Tensor& dx,
                             const at::Tensor& dw, const at::Tensor& db, int64_t rows,
                             int64_t cols) {
  check_rows(rows);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dx.defined()) {
    ln_bwd_dx_f64_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        dy.data_ptr<double>(), x.data_ptr<double>(), mean.data_ptr<double>(),
        rstd.data_ptr<double>(), ptr_or_null(w), dx.data_ptr<double>(), cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (!dw.defined() && !db.defined()) return;
  // Row chunks: enough blocks to fill the GPU, each partial buffer kept under ~32 MB.
  const int64_t col_tiles = (cols + kColTile - 1) / kColTile;
  TORCH_CHECK(col_tiles <= std::numeric_limits<int32_t>::max(), kOp, ": too many columns");
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunks = std::max<int64_t>(1, (sms * 8 + col_tiles - 1) / col_tiles);
  chunks = std::min<int64_t>(chunks, (rows + kColSlices - 1) / kColSlices);
  chunks = std::min<int64_t>(chunks, (int64_t{32} << 20) / (8 * kColSlices * cols));
  chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, 65535));
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t prows = chunks * kColSlices;
  const auto opts = x.options();
  const at::Tensor dw_part = dw.defined() ? at::empty({prows, cols}, opts) : at::Tensor();
  const at::Tensor db_part = db.defined() ? at::empty({prows, cols}, opts) : at::Tensor();
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(chunks));
  ln_bwd_param_f64_kernel<<<grid, dim3(kColTile, kColSlices), 0, stream>>>(
      dy.data_ptr<double>(), x.data_ptr<double>(), mean.data_ptr<double>(),
      rstd.data_ptr<double>(), dw.defined() ? dw_part.data_ptr<double>() : nullptr,
      db.defined() ? db_part.data_ptr<double>() : nullptr, rows, cols, rows_per_chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const unsigned sum_blocks = static_cast<unsigned>((cols + kThreads - 1) / kThreads);
  for (const auto& [part, out] : {std::pair(dw_part, dw), std::pair(db_part, db)}) {
    if (!out.defined()) continue;
    sum_rows_f64_kernel<<<sum_blocks, kThreads, 0, stream>>>(part.data_ptr<double>(), prows, cols,
                                                             out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace fastlayers
