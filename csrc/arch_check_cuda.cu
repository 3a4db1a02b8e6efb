// check_kernel_image: probes a trivial kernel compiled with the same -gencode list as every
// kernel of the extension, so whether the device can run it is whether it can run them.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "arch_check.h"

namespace fastlayers {

namespace {
__global__ void arch_probe_kernel() {}
}  // namespace

void check_kernel_image(int device, const char* op) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<bool>, kMaxDevices> runs_here{};  // static: zero-initialised
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && runs_here[device].load(std::memory_order_relaxed)) return;
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, arch_probe_kernel);
  if (status == cudaSuccess) {
    if (cached) runs_here[device].store(true, std::memory_order_relaxed);
    return;
  }
  (void)cudaGetLastError();  // not a sticky error: clear it, or the next launch check reports it
  if (status == cudaErrorInvalidDeviceFunction || status == cudaErrorNoKernelImageForDevice) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
    TORCH_CHECK(false, op, ": ", arch_mismatch_message(prop->major, prop->minor, prop->name));
  }
  C10_CUDA_CHECK(status);
}

}  // namespace fastlayers
