// The message of arch_check.h, built here (not in a .cu file) because the list of built
// architectures reaches only the host compiler (setup.py).
#include "common/arch_check.h"

#ifndef FASTLAYERS_CUDA_ARCHS  // comma-separated compute capabilities, e.g. 80,90
#define FASTLAYERS_CUDA_ARCHS
#endif

namespace fastlayers {

namespace {

std::string built_archs() {
  static const int archs[] = {0, FASTLAYERS_CUDA_ARCHS};
  std::string out;
  for (size_t i = 1; i < sizeof(archs) / sizeof(archs[0]); ++i)
    out += (i > 1 ? ", sm_" : "sm_") + std::to_string(archs[i]);
  return out.empty() ? "no GPU architecture (a CPU-only build)" : out;
}

}  // namespace

std::string arch_mismatch_message(int major, int minor, const std::string& gpu) {
  const std::string cc = std::to_string(major) + "." + std::to_string(minor);
  // sm_90a, not sm_90: the fused Linear + GELU kernels use Hopper-only instructions.
  const std::string arch = major == 9 && minor == 0 ? "9.0a" : cc;
  return "fastlayers: the compiled extension has no CUDA kernels for this GPU (" + gpu +
         ", compute capability " + cc + ", sm_" + std::to_string(major * 10 + minor) +
         "); it was built for " + built_archs() +
         ". Rebuild it for this GPU from the fastlayers source folder: TORCH_CUDA_ARCH_LIST=\"" +
         arch + "\" pip install --no-build-isolation -e .";
}

}  // namespace fastlayers
