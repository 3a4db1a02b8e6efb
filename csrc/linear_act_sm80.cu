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
  return sm90::tile_count(m, n, tile_of(c).m, tile_of(c).n);
}

Launcher resolve(Dtype dtype, const Problem& p, Config config, const Gpu& gpu) {
  if (config == Config::kAuto) config = choose_config(p.m, p.n, p.k, gpu);
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
// (two resident per SM there) were as fast or faster than 128x256 (one per SM) at 8192 x 768 ->
// 3072 (110.6 against 116.9 us), 8192 x 3072 -> 768 (93.9 / 116.6), 2048 x 768 -> 3072 (31.7 /
// 39.9) and 4096 x 1024 -> 4096 (level); 128x256 won only at 8192 x 4096 -> 16384 (2515 / 2687
// us, 31 waves of its tiles), so where two 128x128 tiles fit an SM, 128x256 takes only long-K
// problems of many waves. Where they do not (an A100's 164 KiB: one resident tile of either size,
// 4 warps against 8), 128x256 takes every problem of a wave or more of its tiles, as CUTLASS's
// own A100 configurations do (not measured here). An sm_86/89's 100 KiB holds one 128x128 tile
// and no 128x256. Below one wave of 128x128 tiles the 64x64 tile keeps the SMs busy: 10.8
// against 16.9 us at 32 x 768 -> 3072, 12.2 against 17.0 at 256 rows; at 1024 rows 128x128 is
// ahead (23.5 against 25.7).
constexpr int64_t kWide128x256MinK = 2048;
constexpr int64_t kWide128x256MinWaves = 8;
constexpr size_t kSharedReservedPerBlock = 1024;  // the driver's per-block reservation (8.x/9.x)

Config choose_config(int64_t m, int64_t n, int64_t k, const Gpu& gpu) {
  if (tiles(m, n, Config::kTile128x128) < gpu.sm_count) return Config::kTile64x64;
  if (shared_memory_refusal(Config::kTile128x256, gpu.shared_per_block) != nullptr)
    return Config::kTile128x128;
  const int64_t wide_tiles = tiles(m, n, Config::kTile128x256);
  const bool two_128x128_per_sm =
      2 * (shared_bytes(Config::kTile128x128) + kSharedReservedPerBlock) <= gpu.shared_per_sm;
  if (two_128x128_per_sm) {
    const bool wide = k >= kWide128x256MinK && wide_tiles >= kWide128x256MinWaves * gpu.sm_count;
    return wide ? Config::kTile128x256 : Config::kTile128x128;
  }
  return wide_tiles >= gpu.sm_count ? Config::kTile128x256 : Config::kTile128x128;
}

const char* shared_memory_refusal(Config config, size_t shared_per_block) {
  if (config == Config::kAuto || shared_bytes(config) <= shared_per_block) return nullptr;
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

size_t workspace_bytes(Dtype dtype, const Problem& p, Config config, const Gpu& gpu) {
  const Launcher l = resolve(dtype, p, config, gpu);
  return l.workspace_bytes ? l.workspace_bytes(p) : 0;
}

const char* run(Dtype dtype, const Problem& p, Config config, const Gpu& gpu, void* workspace,
                Stream stream) {
  const Launcher l = resolve(dtype, p, config, gpu);
  if (l.run == nullptr) return "this sm80 kernel configuration is not compiled in";
  return l.run(p, workspace, stream);
}

}  // namespace sm80
}  // namespace fastlayers
