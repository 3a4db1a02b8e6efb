// Interface of the sm_80 GEMM of the Linear + activation family (CUTLASS 2.x: cp.async multistage
// mainloop, mma.sync tensor cores), for compute capability 8.x (A100, A10G, L4, RTX 30/40): the
// fused forward y = act(x . W^T + bias), optionally storing the pre-activation. The kernels run
// on any GPU from sm_80 on (Hopper too, from their sm_90a code), which is how they are tested and
// timed on an H100 (the raw entry forces them).
// The problem description, dtype and launcher types are the sm90 family's (linear_act_sm90.h);
// only Pass::kForward is implemented here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "linear_act/sm90/linear_act_sm90.h"

namespace fastlayers {
namespace sm80 {

using sm90::Dtype;
using sm90::Launcher;
using sm90::Problem;
using sm90::Stream;

// Tile configurations compiled in (kAuto picks by shape and shared memory).
enum class Config : int {
  kAuto = -1,
  kTile128x256 = 0,  // 128x256x64 tile, 8 warps of 64x64, 3 stages: 144 KiB (A100, H100)
  kTile128x128 = 1,  // 128x128x64 tile, 4 warps of 64x64, 3 stages: 96 KiB (every 8.x)
  kTile64x64 = 2,    // 64x64x64 tile, 4 warps of 32x32, 4 stages: 64 KiB (small problems)
};
constexpr int kNumConfigs = 3;

// The name tests and benchmarks give each config (see sm90::config_name).
inline const char* config_name(Config config) {
  switch (config) {
    case Config::kTile128x256:
      return "tile128x256";
    case Config::kTile128x128:
      return "tile128x128";
    case Config::kTile64x64:
      return "tile64x64";
    default:
      return "auto";
  }
}

// One configuration's tile (rows, columns, k step) and mainloop stages: the CUTLASS kernels are
// instantiated from these, and the dispatch weighs them, so both read the same numbers.
struct Tile {
  int m, n, k, stages, warps_m, warps_n;
};
constexpr Tile kTiles[kNumConfigs] = {
    {128, 256, 64, 3, 2, 4},
    {128, 128, 64, 3, 2, 2},
    {64, 64, 64, 4, 2, 2},
};

constexpr Tile tile_of(Config c) { return kTiles[static_cast<int>(c)]; }

// Shared memory of the mainloop's stages (bytes, 16-bit operands); the epilogue reuses it.
constexpr size_t shared_bytes(Config c) {
  return static_cast<size_t>(tile_of(c).m + tile_of(c).n) * tile_of(c).k * 2 * tile_of(c).stages;
}

// One per (dtype, weight layout), each defined in its own file linear_act_sm80_<dtype>_<layout>.cu
// (n: w [n, k]; t: w stored transposed, [k, n]); empty where the kernels are not compiled in.
Launcher launcher_bf16_n(Config config);
Launcher launcher_bf16_t(Config config);
Launcher launcher_fp16_n(Config config);
Launcher launcher_fp16_t(Config config);

#ifndef FASTLAYERS_WITH_CUTLASS_SM80
#define FASTLAYERS_WITH_CUTLASS_SM80 0
#endif
#if FASTLAYERS_WITH_CUTLASS_SM80
#define FASTLAYERS_SM80_LAUNCHER(NAME, ELEMENT, TRANSPOSED) \
  Launcher NAME(Config config) { return launcher_for<ELEMENT, TRANSPOSED>(config); }
#else
#define FASTLAYERS_SM80_LAUNCHER(NAME, ELEMENT, TRANSPOSED) \
  Launcher NAME(Config) { return {}; }
#endif

// Whether the sm_80 kernels were compiled into this build.
bool kernels_built();

// Whether config is compiled for this dtype and weight layout (kAuto always is, when built).
bool config_available(Dtype dtype, bool w_transposed, Config config);

// What the tile choice needs to know of the GPU.
struct Gpu {
  int sm_count = 0;
  size_t shared_per_block = 0;  // opt-in shared memory per block (bytes)
  size_t shared_per_sm = 0;     // shared memory per SM (bytes)
};

// The configuration kAuto runs for an m x n x k problem on gpu.
Config choose_config(int64_t m, int64_t n, int64_t k, const Gpu& gpu);

// Why an m x n x k problem should not run on these kernels by default on a GPU with sm_count SMs
// (nullptr: it should), and why config cannot run on a GPU with shared_per_block bytes of opt-in
// shared memory per block (nullptr: it can).
const char* size_refusal(int64_t m, int64_t n, int64_t k, int sm_count);
const char* shared_memory_refusal(Config config, size_t shared_per_block);

// The problems size_refusal lets these kernels take, in words (for `python -m fastlayers env`).
std::string size_rule_text();

// Launches p (Pass::kForward; p.config and p.sm_count are not read) with config on stream; kAuto
// is resolved by choose_config. Returns nullptr on success, else a message saying what failed.
const char* run(Dtype dtype, const Problem& p, Config config, const Gpu& gpu, void* workspace,
                Stream stream);
size_t workspace_bytes(Dtype dtype, const Problem& p, Config config, const Gpu& gpu);

}  // namespace sm80
}  // namespace fastlayers
