// Dispatch over the compiled sm_80 Linear + activation GEMMs (linear_act_sm80_*.cu): picks the
// tile configuration and the (dtype, weight layout) instantiation. No CUTLASS here.
#include "linear_act_sm80.h"

#include <cstdint>

namespace fastlayers {
namespace sm80 {

namespace {

Launcher launcher(Dtype dtype, bool w_transposed, Config config) {
  if (dtype == Dtype::kBFloat16)
    return w_transposed ? launcher_bf16_t(config) : launcher_bf16_n(config);
  return w_transposed ? launcher_fp16_t(config) : launcher_fp16_n(config);
}

int64_t tiles(int64_t m, int64_t n, Config c) {
  const Tile t = tile_of(c);
  return ((m + t.m - 1) / t.m) * ((n + t.n - 1) / t.n);
}

Launcher resolve(Dtype dtype, const Problem& p, Config config, size_t max_shared_bytes) {
  if (config == Config::kAuto)
    config = choose_config(p.m, p.n, p.k, p.sm_count, max_shared_bytes);
  return launcher(dtype, p.w_transposed, config);
}

}  // namespace

bool kernels_built() { return FASTLAYERS_WITH_CUTLASS_SM80 != 0; }

bool config_available(Dtype dtype, bool w_transposed, Config config) {
  if (config == Config::kAuto) return kernels_built();
  return launcher(dtype, w_transposed, config).run != nullptr;
}

// These kernels are not persistent: the grid holds every output tile. Measured on an H100 with the
// kernels forced (bf16, benchmarks/bench_sm80.py; RESULTS.md), identity epilogue: 128x128 tiles
// (two resident per SM there, one on an A100 or an sm_86/89) were as fast or faster than 128x256
// at 8192 x 768 -> 3072 (110.6 against 116.9 us), 8192 x 3072 -> 768 (93.9 / 116.6), 2048 x 768
// -> 3072 (31.7 / 39.9) and 4096 x 1024 -> 4096 (level); 128x256 won only at 8192 x 4096 ->
// 16384 (2515 / 2687 us, 31 waves of its tiles), so it takes long-K problems of many waves. Below
// one wave of 128x128 tiles the 64x64 tile keeps the SMs busy: 10.8 against 16.9 us at 32 x 768
// -> 3072, 12.2 against 17.0 at 256 rows; at 1024 rows 128x128 is ahead (23.5 against 25.7).
constexpr int64_t kWide128x256MinK = 2048;
constexpr int64_t kWide128x256MinWaves = 8;

Config choose_config(int64_t m, int64_t n, int64_t k, int sm_count, size_t max_shared_bytes) {
  if (tiles(m, n, Config::kTile128x128) < sm_count) return Config::kTile64x64;
  if (k >= kWide128x256MinK &&
      shared_memory_refusal(Config::kTile128x256, max_shared_bytes) == nullptr &&
      tiles(m, n, Config::kTile128x256) >= kWide128x256MinWaves * sm_count)
    return Config::kTile128x256;
  return Config::kTile128x128;
}

const char* shared_memory_refusal(Config config, size_t max_shared_bytes) {
  if (config == Config::kAuto || shared_bytes(config) <= max_shared_bytes) return nullptr;
  return "its tile needs more shared memory per block than this GPU has";
}

// No sm_8x GPU was lent to measure these kernels where they serve by default; on an H100, forced
// (above), the fused activation cost 0-10% over the same kernel's bare GEMM, where the
// activation as a pass of its own cost 22-33% up to K = 2048 but only 9-11% at K = 3072 and
// 4096. So the fusion pays for itself by a wide margin up to K = 2048, and past it only if this
// mainloop runs within a few per cent of cuBLAS's on the 8.x GPU, unmeasured: those calls keep
// cuBLAS + the pass.
constexpr int64_t kMaxDefaultK = 2048;

const char* size_refusal(int64_t, int64_t, int64_t k, int) {
  if (k > kMaxDefaultK)
    return "in_features over 2048 on an 8.x GPU: the activation pass the fusion saves is about "
           "10% of the GEMM there, and this kernel's GEMM is not measured against cuBLAS's on 8.x";
  return nullptr;
}

size_t workspace_bytes(Dtype dtype, const Problem& p, Config config, size_t max_shared_bytes) {
  const Launcher l = resolve(dtype, p, config, max_shared_bytes);
  return l.workspace_bytes ? l.workspace_bytes(p) : 0;
}

const char* run(Dtype dtype, const Problem& p, Config config, size_t max_shared_bytes,
                void* workspace, Stream stream) {
  const Launcher l = resolve(dtype, p, config, max_shared_bytes);
  if (l.run == nullptr) return "this sm80 kernel configuration is not compiled in";
  return l.run(p, workspace, stream);
}

}  // namespace sm80
}  // namespace fastlayers
