// The sm_80 Linear + activation GEMMs' size rule: which problems they take by default on an 8.x
// GPU, on which tile configuration, and the rule in words for `python -m fastlayers env`. Plain
// C++, compiled in every build (tests and the env report read it on any machine).
#include <string>

#include "linear_act/sm80/linear_act_sm80.h"

namespace fastlayers {
namespace sm80 {

namespace {

int64_t tiles(int64_t m, int64_t n, Config c) {
  return sm90::tile_count(m, n, tile_of(c).m, tile_of(c).n);
}

}  // namespace

// These kernels are not persistent: the grid holds every output tile. Measured on an H100 with the
// kernels forced (bf16, benchmarks/bench_sm80.py; docs/decisions.md), identity epilogue: 128x128
// tiles (two resident per SM there) were as fast or faster than 128x256 (one per SM) at 8192 x 768
// -> 3072 (110.6 against 116.9 us), 8192 x 3072 -> 768 (93.9 / 116.6), 2048 x 768 -> 3072 (31.7 /
// 39.9) and 4096 x 1024 -> 4096 (level); 128x256 won only at 8192 x 4096 -> 16384 (2516 / 2687 us,
// 31 waves of its tiles), so where two 128x128 tiles fit an SM, 128x256 takes only long-K problems
// of many waves. Where they do not (an A100's 164 KiB: one resident tile of either size, 4 warps
// against 8), 128x256 takes every problem of a wave or more of its tiles, as CUTLASS's own A100
// configurations do (not measured here). An sm_86/89's 100 KiB holds one 128x128 tile and no
// 128x256. Below one wave of 128x128 tiles the 64x64 tile keeps the SMs busy: 11.5 against 16.0 us
// at 32 x 768 -> 3072, 12.5 against 15.4 at 256 rows; at 1024 rows 128x128 is ahead (21.3 against
// 25.4).
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

std::string size_rule_text() {
  return "in_features up to " + std::to_string(kMaxDefaultK) +
         " (unmeasured on 8.x GPUs: timed on an H100 only, see benchmarks/RESULTS.md)";
}

}  // namespace sm80
}  // namespace fastlayers
