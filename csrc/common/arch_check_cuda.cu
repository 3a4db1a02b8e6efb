// check_kernel_image: probes a trivial kernel compiled with the same -gencode list as every
// kernel of the extension, so whether the device can run it is whether it can run them.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "common/arch_check.h"

namespace fastlayers {

namespace {
__global__ void arch_probe_kernel() {}

constexpr int kMaxDevices = 64;
// Per device: 0 not probed yet, 1 kernels run, 2 no kernel image. Static: zero-initialised.
std::array<std::atomic<int>, kMaxDevices> probed{};

// The probe on the current device: true when it runs, false when the build has no image for it.
bool probe_current_device() {
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, arch_probe_kernel);
  if (status == cudaSuccess) return true;
  (void)cudaGetLastError();  // not a sticky error: clear it, or the next launch check reports it
  if (status == cudaErrorInvalidDeviceFunction || status == cudaErrorNoKernelImageForDevice)
    return false;
  C10_CUDA_CHECK(status);
  return false;
}

// The cached answer for `device`, which must be the current device.
bool runs_on_current(int device) {
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached) {
    const int state = probed[device].load(std::memory_order_relaxed);
    if (state != 0) return state == 1;
  }
  const bool runs = probe_current_device();
  if (cached) probed[device].store(runs ? 1 : 2, std::memory_order_relaxed);
  return runs;
}
}  // namespace

bool kernels_run_on(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return runs_on_current(device);
}

void check_kernel_image(int device, const char* op) {
  if (runs_on_current(device)) return;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  TORCH_CHECK(false, op, ": ", arch_mismatch_message(prop->major, prop->minor, prop->name));
}

}  // namespace fastlayers
