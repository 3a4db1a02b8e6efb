// Float math beside wgmma on one SM: how fast the GELU epilogue's math runs in one or two warp
// groups, alone and while another warp group of the SM runs wgmma, and how much it slows the
// wgmma down. Issue 20 asked whether moving the activation into warps of its own (not the ones
// holding the accumulators) would hide it; measured on an H100 (RESULTS.md), no: beside wgmma the
// math runs 1.4-1.6x slower and slows the wgmma by 1.1-1.4x (plain FFMA chains: 1.6-2.4x), so
// the two contend for the SM whichever warps issue the math, and a second math warp group adds
// little math throughput. What pays is fewer float instructions per element.
//
// One CTA per SM, three warp groups: warp group 0 runs wgmma (128x128 tile, K = 128 from
// shared memory, 16 wgmma per batch, no global traffic; optionally storing the accumulators to
// shared memory after each batch, the hand-off such a design would need), warp groups 1 and 2
// run a GELU form of gelu_epilogue.cuh (or its derivative, or plain FFMA chains) on 32 register
// floats per thread. Each role's warps time their own loop with clock64.
// scripts/wgmma_contention.sh builds and runs it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <vector>

#include "../csrc/gelu_epilogue.cuh"

namespace wgmma_contention {

using namespace cute;

constexpr int kTileM = 128, kTileN = 128, kTileK = 128;
constexpr int kElems = 32;  // math values per thread per round (one 64x64 epilogue subtile)

using Element = cutlass::bfloat16_t;
using SmemLayoutA =
    decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kTileM>, Int<kTileK>>{}));
using SmemLayoutB =
    decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kTileN>, Int<kTileK>>{}));
constexpr int kSmemBytes =
    (kTileM + kTileN) * kTileK * sizeof(Element) + kTileM * kTileN * sizeof(float);

// The erf forms the epilogue used before its log-space Phi (gelu_epilogue.cuh), kept here for the
// comparison: the sigmoid form Phi = 1 / (1 + 2^(z Q(z^2))), Q of degree 6, ex2 and rcp.
namespace previous {
namespace ge = fastlayers::gelu_epilogue;
__device__ __forceinline__ float erf_cdf(float z) {
  const float s = z * z;
  float q = -5.269206759e-09f;
  q = fmaf(q, s, 3.876988025e-07f);
  q = fmaf(q, s, -1.149599804e-05f);
  q = fmaf(q, s, 1.597183189e-04f);
  q = fmaf(q, s, 9.442279125e-05f);
  q = fmaf(q, s, -1.048367986e-01f);
  q = fmaf(q, s, -2.302208050e+00f);
  return ge::rcp_approx(1.f + ge::ex2_approx(z * q));
}
__device__ __forceinline__ float gelu_erf_grad(float z) {
  const float phi = ge::ex2_approx(fmaf(-0.7213475204444817f, z * z, -1.3257480647361593f));
  return fmaf(z, phi, erf_cdf(z));
}
}  // namespace previous

enum MathKind : int { kErf, kErfPrevious, kErfGrad, kErfGradPrevious, kTanh, kTanhGrad, kFfma,
                      kNumKinds };
const char* const kKindNames[kNumKinds] = {"erf",  "erf, sigmoid form", "erf'", "erf', sigmoid form",
                                           "tanh", "tanh'",             "ffma x12"};

// One value through the kind's function (a gelu, or x * gelu'(x) for the derivatives).
__device__ __forceinline__ float math_value(float x, int kind) {
  namespace ge = fastlayers::gelu_epilogue;
  switch (kind) {
    case kErf: return ge::gelu_erf(x);
    case kErfPrevious: return x * previous::erf_cdf(x);
    case kErfGrad: return x * ge::gelu_erf_grad(x);
    case kErfGradPrevious: return x * previous::gelu_erf_grad(x);
    case kTanh: return ge::gelu_tanh(x);
    case kTanhGrad: return x * ge::gelu_tanh_grad(x);
    default: {
      // 12 dependent FFMAs, about the sigmoid erf form's float instruction count
#pragma unroll
      for (int j = 0; j < 12; ++j) x = fmaf(x, 0.5f, 0.25f);
      return x;
    }
  }
}

// Each element's result feeds its next round, so the rounds cannot overlap; the kind is
// uniform, so the branch is taken once per round (outside the unrolled elements).
template <int kKind>
__device__ __forceinline__ void math_round_of(float (&v)[kElems]) {
#pragma unroll
  for (int i = 0; i < kElems; ++i) v[i] = math_value(v[i], kKind) - 0.25f;
}

__device__ __forceinline__ void math_round(float (&v)[kElems], int kind) {
  switch (kind) {
    case kErf: return math_round_of<kErf>(v);
    case kErfPrevious: return math_round_of<kErfPrevious>(v);
    case kErfGrad: return math_round_of<kErfGrad>(v);
    case kErfGradPrevious: return math_round_of<kErfGradPrevious>(v);
    case kTanh: return math_round_of<kTanh>(v);
    case kTanhGrad: return math_round_of<kTanhGrad>(v);
    default: return math_round_of<kFfma>(v);
  }
}

__global__ void __launch_bounds__(384, 1)
    contention(int mma_iters, int math_iters, int math_groups, int kind, int store_acc,
               float* sink, long long* cycles) {
  extern __shared__ __align__(1024) unsigned char smem[];
  Element* smem_a = reinterpret_cast<Element*>(smem);
  Element* smem_b = smem_a + kTileM * kTileK;
  // operands: small non-zero values (zeros would idle the tensor cores' datapath)
  for (int i = threadIdx.x; i < (kTileM + kTileN) * kTileK; i += blockDim.x)
    smem_a[i] = Element(0.01f * float((i * 37 + blockIdx.x) % 97 - 48));
  __syncthreads();

  const int group = threadIdx.x / 128;
  const int lane_group = threadIdx.x % 128;
  long long t0 = clock64();
  float result = 0.f;
  if (group == 0) {
    if (mma_iters > 0) {
      Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});
      Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});
      TiledMMA mma = make_tiled_mma(SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{});
      ThrMMA thr = mma.get_slice(lane_group);
      Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
      Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
      Tensor acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<kTileN>>{});
      clear(acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
      for (int it = 0; it < mma_iters; ++it) {
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        gemm(mma, tCrA, tCrB, acc);
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        if (store_acc) {
          // the accumulator tile's hand-off to other warps: 64 KB of float4 stores
          float4* out = reinterpret_cast<float4*>(smem_b + kTileN * kTileK);
#pragma unroll
          for (int i = 0; i < size(acc) / 4; ++i)
            out[i * 128 + lane_group] = make_float4(acc(4 * i), acc(4 * i + 1), acc(4 * i + 2),
                                                    acc(4 * i + 3));
          cutlass::arch::NamedBarrier::sync(128, 1);
        }
      }
      for (int i = 0; i < size(acc); ++i) result += acc(i);
    }
  } else if (group <= math_groups) {
    float v[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i) v[i] = 0.37f * float((lane_group + 3 * i) % 11 - 5);
    for (int it = 0; it < math_iters; ++it) math_round(v, kind);
#pragma unroll
    for (int i = 0; i < kElems; ++i) result += v[i];
  }
  long long t1 = clock64();
  sink[blockIdx.x * blockDim.x + threadIdx.x] = result;
  if (threadIdx.x % 32 == 0) cycles[blockIdx.x * 12 + threadIdx.x / 32] = t1 - t0;
}

struct Timing {
  double mma_cycles = 0, math_cycles = 0, ms = 0;
};

Timing run(int sms, int mma_iters, int math_iters, int math_groups, int kind, float* sink,
           long long* cycles, int store_acc = 0) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  contention<<<sms, 384, kSmemBytes>>>(mma_iters, math_iters, math_groups, kind, store_acc, sink,
                                       cycles);
  cudaEventRecord(a);
  contention<<<sms, 384, kSmemBytes>>>(mma_iters, math_iters, math_groups, kind, store_acc, sink,
                                       cycles);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  Timing t;
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  t.ms = ms;
  std::vector<long long> host(sms * 12);
  cudaMemcpy(host.data(), cycles, host.size() * sizeof(long long), cudaMemcpyDeviceToHost);
  double mma = 0, math = 0;
  int n_math = 0;
  for (int s = 0; s < sms; ++s) {
    for (int w = 0; w < 4; ++w) mma += host[s * 12 + w];
    for (int w = 4; w < 4 + 4 * math_groups; ++w, ++n_math) math += host[s * 12 + w];
  }
  t.mma_cycles = mma / (4.0 * sms);
  t.math_cycles = n_math ? math / n_math : 0;
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t;
}

}  // namespace wgmma_contention

int main() {
  using namespace wgmma_contention;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(contention, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  float* sink;
  long long* cycles;
  cudaMalloc(&sink, sms * 384 * sizeof(float));
  cudaMalloc(&cycles, sms * 12 * sizeof(long long));
  const int mma_iters = 4000;  // a 128x128x128 batch per iteration
  const int math_iters = 1000;  // 32 elements per thread per iteration
  const double mma_flop = 2.0 * kTileM * kTileN * kTileK * mma_iters * sms;
  Timing alone = run(sms, mma_iters, 0, 0, kErf, sink, &cycles[0]);
  printf("wgmma alone: %.0f cycles per batch of 128x128x128 (%.1f TFLOP/s over %.3f ms)\n",
         alone.mma_cycles / mma_iters, mma_flop / alone.ms / 1e9, alone.ms);
  Timing stored = run(sms, mma_iters, 0, 0, kErf, sink, cycles, /*store_acc=*/1);
  printf("wgmma + the accumulators stored to shared memory after each batch: %.0f cycles\n",
         stored.mma_cycles / mma_iters);
  for (int kind = 0; kind < kNumKinds; ++kind) {
    for (int groups = 1; groups <= 2; ++groups) {
      Timing math = run(sms, 0, math_iters, groups, kind, sink, cycles);
      // math short beside a long wgmma loop: the math's own rate under wgmma
      Timing both = run(sms, mma_iters, math_iters, groups, kind, sink, cycles);
      // math long beside a short wgmma loop: wgmma's rate under the math
      Timing both_long = run(sms, mma_iters / 4, math_iters * 8, groups, kind, sink, cycles);
      const double per_elem = 1.0 / (math_iters * kElems);
      printf(
          "%-19s math warp groups %d: math alone %.2f cycles/element/thread, beside wgmma %.2f "
          "(x%.2f); wgmma beside math %.0f cycles/batch (x%.2f of alone)\n",
          kKindNames[kind], groups, math.math_cycles * per_elem, both.math_cycles * per_elem,
          both.math_cycles / math.math_cycles, both_long.mma_cycles / (mma_iters / 4),
          both_long.mma_cycles / (mma_iters / 4) / (alone.mma_cycles / mma_iters));
    }
  }
  cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
