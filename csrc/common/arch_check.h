// A clear error, instead of CUDA's "no kernel image is available", when the extension was built
// for other GPU architectures than the one a call runs on.
#pragma once

#include <string>

namespace fastlayers {

// The error for a GPU of compute capability major.minor named `gpu`: what the extension was
// built for and the command that rebuilds it for this GPU (arch_check.cpp: the list of built
// architectures reaches only the host compiler).
std::string arch_mismatch_message(int major, int minor, const std::string& gpu);

// Whether this extension holds a kernel image that runs on CUDA device `device` (probed once per
// device under a device guard, then cached; arch_check_cuda.cu). Never raises for a missing
// image; other CUDA errors do raise.
bool kernels_run_on(int device);

// Raises arch_mismatch_message when this extension holds no kernel image that runs on CUDA
// device `device` (the current device: callers hold a device guard). Probed once per device,
// then one relaxed atomic load per call (arch_check_cuda.cu).
void check_kernel_image(int device, const char* op);

}  // namespace fastlayers
