// The tensor-core throughput that mma.sync (the sm_80 instruction, which the sm_80 fused kernel
// of issue 20 is built on) reaches on this GPU: register operands only, no memory traffic, so
// it bounds any mma.sync GEMM from above. scripts/mma_sync_peak.sh builds and runs it beside
// cuBLAS's bare GEMM (wgmma on Hopper).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>

namespace {

constexpr int kChains = 8;  // independent accumulators per warp: covers the MMA latency
constexpr int kIters = 4096;

__global__ void mma_loop(float* out, int write) {
  // Operand registers from the thread index, so the compiler cannot fold them.
  unsigned a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ (threadIdx.x * (i + 1));
  for (int i = 0; i < 2; ++i) b[i] = 0x3f803f80u ^ (threadIdx.x * (i + 7));
  float c[kChains][4] = {};
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  if (write) {
    float s = 0.f;
    for (int j = 0; j < kChains; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  }
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  float* out = nullptr;
  const int sms = prop.multiProcessorCount;
  cudaMalloc(&out, sizeof(float) * sms * 8 * 1024);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int warps_per_block : {4, 8, 16}) {
    for (int blocks_per_sm : {1, 2}) {
      const int blocks = sms * blocks_per_sm, threads = 32 * warps_per_block;
      mma_loop<<<blocks, threads>>>(out, 0);  // warm-up (and clocks up)
      float best = 1e30f;
      for (int rep = 0; rep < 5; ++rep) {
        cudaEventRecord(start);
        mma_loop<<<blocks, threads>>>(out, 0);
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms = 0.f;
        cudaEventElapsedTime(&ms, start, stop);
        best = ms < best ? ms : best;
      }
      const double mmas = double(kChains) * kIters * blocks * warps_per_block;
      const double flops = 2.0 * 16 * 8 * 16 * mmas;
      std::printf("mma.sync m16n8k16 bf16->f32: %2d warps/block x %d blocks/SM: %7.1f TFLOP/s\n",
                  warps_per_block, blocks_per_sm, flops / (best * 1e-3) / 1e12);
    }
  }
  const cudaError_t err = cudaGetLastError();
  std::printf("%s (%s, %d SMs)\n", cudaGetErrorString(err), prop.name, sms);
  return err == cudaSuccess ? 0 : 1;
}
