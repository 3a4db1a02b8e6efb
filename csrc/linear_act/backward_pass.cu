// The backward elementwise pass of the Linear + activation ops and the bias gradients' fixed-order
// column sums (declared in backward_pass.h): dz = dL/dz from dy and the saved tensor (z, or y for
// ReLU) with per-chunk column sums of dz, and the kernel that finishes column partial sums (the
// pass's chunks, the fused backward GEMM's tiles) in a fixed order: deterministic.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

#include "common/common.h"
#include "common/elementwise.cuh"
#include "linear_act/backward_pass.h"

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.linear_act";

// ------------------------------------------------------------------------------------------
// Backward elementwise pass: dz = dL/dz from dy and saved (z, or y for ReLU), and the column sums
// of dz per row chunk.
// A block covers kLanes * VEC columns and one chunk of rows: kLanes threads across the columns
// (16-byte vectors), kPhases across the rows, kUnroll rows in flight per thread.
constexpr int kLanes = 32;
constexpr int kPhases = 8;
constexpr int kUnroll = 4;
// Resident blocks per SM the register budget must allow (3: 80 registers a thread, no spills;
// 4 spilled): with 2 (124 registers) the pass ran at 55% of DRAM bandwidth on an H100 (ncu).
constexpr int kMinBlocksPerSM = 3;
// Up to this many rows the pass runs one chunk and writes the bias gradient itself: the column
// sums are then too short to spread over more blocks, and the finishing kernel's launch cost
// more than the rest of the bias gradient (H100, bench_mlp.py --few-rows).
constexpr int64_t kOneChunkRows = 128;

template <typename T, int VEC, typename A>
__device__ __forceinline__ void load_vec(const T* p, A (&out)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    cuda::load_floats<T, VEC>(p, out);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = static_cast<A>(p[k]);
  }
}

template <typename T, int VEC, typename A>
__device__ __forceinline__ void store_vec(T* p, const A (&in)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    cuda::store_floats<T, VEC>(p, in);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = static_cast<T>(in[k]);
  }
}

// dz and db_part may each be null; saved too for the identity (column sums of dy). VEC divides
// n (VEC = 1 on the scalar path). The math and the column sums run in A = at::opmath_type<T>
// (float; double for float64). With one chunk of rows, db (when not null) receives the column
// sums rounded to T instead of db_part.
template <typename T, int VEC, typename A = at::opmath_type<T>>
__global__ void __launch_bounds__(kLanes* kPhases, kMinBlocksPerSM)
    dact_bias_kernel(const T* __restrict__ dy, const T* __restrict__ saved, T* __restrict__ dz,
                     A* __restrict__ db_part, T* __restrict__ db, int64_t m, int64_t n,
                     int64_t rows_per_chunk, Activation act) {
  const int lane = threadIdx.x, phase = threadIdx.y;
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kLanes + lane) * VEC;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(m, r0 + rows_per_chunk);
  const bool active = col < n;
  A acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = A(0);
  // One row's VEC elements: dz and the column sums from dy's and saved's values.
  const auto apply = [&](int64_t row, const A (&g)[VEC], const A (&zz)[VEC]) {
    A out[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      out[k] = activation_grad(g[k], zz[k], act);
      acc[k] += out[k];
    }
    if (dz != nullptr) store_vec<T, VEC>(dz + row * n + col, out);
  };
  if (active) {
    for (int64_t r = r0 + phase; r < r1; r += kPhases * kUnroll) {
      if constexpr (VEC * sizeof(T) == 16) {
        // all kUnroll rows in flight as raw 16-byte words (half the registers of floats for
        // 16-bit types: ncu measured 124 registers and 2 blocks per SM with float arrays, the
        // pass at 55% of DRAM bandwidth), converted where used
        cuda::RawVec<T, VEC> graw[kUnroll], zraw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t row = r + u * kPhases;
          if (row < r1) {
            graw[u] = cuda::load_raw<T, VEC>(dy + row * n + col);
            if (saved != nullptr) zraw[u] = cuda::load_raw<T, VEC>(saved + row * n + col);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t row = r + u * kPhases;
          if (row < r1) {
            A g[VEC], zz[VEC];
            cuda::unpack_floats<T, VEC>(graw[u], g);
            if (saved != nullptr) {
              cuda::unpack_floats<T, VEC>(zraw[u], zz);
            } else {
#pragma unroll
              for (int k = 0; k < VEC; ++k) zz[k] = A(0);
            }
            apply(row, g, zz);
          }
        }
      } else {
        A g[kUnroll][VEC], zz[kUnroll][VEC];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t row = r + u * kPhases;
          if (row < r1) {
            load_vec<T, VEC>(dy + row * n + col, g[u]);
#pragma unroll
            for (int k = 0; k < VEC; ++k) zz[u][k] = A(0);
            if (saved != nullptr) load_vec<T, VEC>(saved + row * n + col, zz[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t row = r + u * kPhases;
          if (row < r1) apply(row, g[u], zz[u]);
        }
      }
    }
  }
  if (db_part == nullptr && db == nullptr) return;
  __shared__ A sums[kPhases][kLanes * VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) sums[phase][lane * VEC + k] = acc[k];
  __syncthreads();
  if (phase == 0 && active) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      A s = A(0);
#pragma unroll
      for (int p = 0; p < kPhases; ++p) s += sums[p][lane * VEC + k];
      if (db != nullptr) {
        db[col + k] = static_cast<T>(s);
      } else {
        db_part[static_cast<int64_t>(blockIdx.y) * n + col + k] = s;
      }
    }
  }
}

// The bias gradient from column sums per row chunk: each column of part ([rows, n] in A) summed in
// a fixed order (kRowPhases interleaved partial sums, then those in order), rounded once to T. One
// kernel where ATen's sum(0) and a cast were two. Each thread's loads form a dependent chain, so
// longer part arrays take more phases: the backward pass's chunks (~130 at 8192 x 768) kPhases
// when they are finished right after the pass, in L2 (its order, and so its bits, as before; 32
// phases there: 0.2-0.3 us slower), the fused backward GEMM's partials (one row per warp of each
// row tile, 256 rows at 8192 x 3072) kPartialRowPhases, and so the pass's chunks where they share
// that launch (the MLP's db2, out of L2 by then: in 8 phases, 17 loads from DRAM, 5 us). Eight
// loads in flight per thread, in the same order, took 54 registers (one 1024-thread block per SM)
// and were slower (H100).
constexpr int kPartialRowPhases = 32;

template <typename T, typename A>
struct FinishJob {
  const A* part = nullptr;
  T* out = nullptr;
  int64_t rows = 0, n = 0;
  __host__ __device__ int64_t blocks() const {
    return part == nullptr ? 0 : (n + kLanes - 1) / kLanes;
  }
};

// Up to two finishes in one launch (the MLP's two bias gradients: one small kernel's time instead
// of two): blocks [0, first.blocks()) finish first, the rest second. A block covers kLanes columns.
template <typename T, typename A, int kRowPhases>
__global__ void __launch_bounds__(kLanes* kRowPhases)
    finish_column_sums_kernel(const FinishJob<T, A> first, const FinishJob<T, A> second) {
  const int64_t first_blocks = first.blocks();
  const bool is_first = blockIdx.x < first_blocks;
  // the job's fields one by one (a reference to either parameter would copy both to the stack)
  const A* part = is_first ? first.part : second.part;
  const int64_t rows = is_first ? first.rows : second.rows;
  const int64_t n = is_first ? first.n : second.n;
  const int64_t strip = is_first ? blockIdx.x : blockIdx.x - first_blocks;
  const int lane = threadIdx.x, phase = threadIdx.y;
  const int64_t col = strip * kLanes + lane;
  A s = A(0);
  if (col < n) {
    for (int64_t c = phase; c < rows; c += kRowPhases) s += part[c * n + col];
  }
  __shared__ A sums[kRowPhases][kLanes];
  sums[phase][lane] = s;
  __syncthreads();
  if (phase == 0 && col < n) {
    A total = A(0);
#pragma unroll
    for (int p = 0; p < kRowPhases; ++p) total += sums[p][lane];
    (is_first ? first.out : second.out)[col] = static_cast<T>(total);
  }
}

// Launches finish_column_sums_kernel for one or two jobs (a job with a null part is skipped).
template <int kRowPhases, typename T, typename A>
void launch_finish_column_sums(const FinishJob<T, A>& first, const FinishJob<T, A>& second,
                               cudaStream_t stream) {
  const int64_t blocks = first.blocks() + second.blocks();
  if (blocks == 0) return;
  finish_column_sums_kernel<T, A, kRowPhases>
      <<<static_cast<unsigned>(blocks), dim3(kLanes, kRowPhases), 0, stream>>>(first, second);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The finish of a DactSums' per-chunk sums (none where the pass wrote db itself).
template <typename T, typename A>
FinishJob<T, A> finish_job(const DactSums& sums) {
  if (!sums.part.defined()) return {};
  return {sums.part.data_ptr<A>(), sums.db.data_ptr<T>(), sums.part.size(0), sums.part.size(1)};
}

}  // namespace

// The four entries below: see backward_pass.h.
DactSums launch_dact_pass(const at::Tensor& dy, const at::Tensor& saved, const at::Tensor& dz,
                          bool want_db, Activation act) {
  const int64_t m = dy.size(0), n = dy.size(1);
  DactSums sums;
  if (m == 0 || n == 0) {
    if (want_db) sums.db = at::zeros({n}, dy.options());
    return sums;
  }
  const auto acc_opts = dy.options().dtype(dy.scalar_type() == at::kDouble ? at::kDouble
                                                                           : at::kFloat);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  dispatch_dtype_f64(dy.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = at::opmath_type<T>;
    constexpr int V = cuda::vec_of<T>();
    const T* pdy = dy.data_ptr<T>();
    const T* pz = saved.defined() ? saved.data_ptr<T>() : nullptr;
    T* pdz = dz.defined() ? dz.data_ptr<T>() : nullptr;
    const bool vectorized = n % V == 0 && cuda::aligned16(pdy) && cuda::aligned16(pz) &&
                            cuda::aligned16(pdz);
    const int64_t cols_per_block = int64_t{kLanes} * (vectorized ? V : 1);
    const int64_t strips = (n + cols_per_block - 1) / cols_per_block;
    TORCH_CHECK(strips <= std::numeric_limits<int32_t>::max(), kOp, ": too many columns");
    // One wave (kMinBlocksPerSM blocks per SM), each chunk at least one full pass of its
    // threads over rows.
    const int64_t min_rows = int64_t{kPhases} * kUnroll;
    // (rounded down: a few blocks past the wave ran alone, +13% at 8192 x 4096, H100)
    int64_t chunks = std::max<int64_t>(1, (int64_t{kMinBlocksPerSM} * sms) / strips);
    chunks = std::min({chunks, (m + min_rows - 1) / min_rows, int64_t{65535}});
    if (m <= kOneChunkRows) chunks = 1;
    const int64_t rows_per_chunk = (m + chunks - 1) / chunks;
    chunks = (m + rows_per_chunk - 1) / rows_per_chunk;
    // one chunk: the pass writes db itself; else per-chunk sums, finished by the caller
    const bool one_chunk = chunks == 1;
    if (want_db) sums.db = at::empty({n}, dy.options());
    if (want_db && !one_chunk) sums.part = at::empty({chunks, n}, acc_opts);
    A* pdb = sums.part.defined() ? sums.part.data_ptr<A>() : nullptr;
    T* pdb_done = want_db && one_chunk ? sums.db.data_ptr<T>() : nullptr;
    const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(chunks));
    const dim3 block(kLanes, kPhases);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (vectorized) {
      dact_bias_kernel<T, V><<<grid, block, 0, stream>>>(pdy, pz, pdz, pdb, pdb_done, m, n,
                                                         rows_per_chunk, act);
    } else {
      dact_bias_kernel<T, 1><<<grid, block, 0, stream>>>(pdy, pz, pdz, pdb, pdb_done, m, n,
                                                         rows_per_chunk, act);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return sums;
}

at::Tensor launch_dact(const at::Tensor& dy, const at::Tensor& saved, const at::Tensor& dz,
                       bool want_db, Activation act) {
  const DactSums sums = launch_dact_pass(dy, saved, dz, want_db, act);
  if (sums.part.defined()) {
    dispatch_dtype_f64(dy.scalar_type(), kOp, [&](auto tag) {
      using T = typename decltype(tag)::type;
      using A = at::opmath_type<T>;
      launch_finish_column_sums<kPhases, T, A>(finish_job<T, A>(sums), {},
                                               at::cuda::getCurrentCUDAStream());
    });
  }
  return sums.db;
}

// ATen's t2.sum(0) took 38 us for 8192 x 3072 bf16 on an H100, twice the bytes' time.
at::Tensor column_sums(const at::Tensor& t2) {
  return launch_dact(t2, at::Tensor(), at::Tensor(), /*want_db=*/true, Activation::kIdentity);
}

at::Tensor finish_bias_grads(const at::Tensor& partials, at::ScalarType dtype,
                             const DactSums& also) {
  at::Tensor db;
  dispatch_dtype(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    FinishJob<T, float> job;
    if (partials.defined()) {
      db = at::empty({partials.size(1)}, partials.options().dtype(dtype));
      job = {partials.data_ptr<float>(), db.data_ptr<T>(), partials.size(0), partials.size(1)};
    }
    launch_finish_column_sums<kPartialRowPhases, T, float>(finish_job<T, float>(also), job,
                                                           at::cuda::getCurrentCUDAStream());
  });
  return db;
}


}  // namespace fastlayers
