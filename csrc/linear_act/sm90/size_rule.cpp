// The sm_90a Linear + activation GEMMs' size rule: which problems the fused kernels take, on which
// tile configuration, and the same rule in words for `python -m fastlayers env`. Plain C++ (no
// CUDA or CUTLASS), compiled in every build, so that tests and the env report read the rule from
// here on any machine.
#include <string>

#include "linear_act/sm90/linear_act_sm90.h"

namespace fastlayers {
namespace sm90 {

namespace {

// Above this inner dimension the 128-column kernels are the cooperative 256x128 ones, and 64x64
// tiles stay ahead of cuBLAS only up to one per SM (below).
constexpr int64_t kLongK = 2048;

// Up to this inner dimension the backward GEMM (dz + db) runs fused at any size (the
// measurements are size_refusal's comment).
constexpr int64_t kBackwardAnyFillMaxK = 1024;

// Whether the output is small enough for 64x64 tiles (kPingpong64x64). Measured on an H100
// (132 SMs), bf16: up to K = 2048 they beat every other config and eager up to three tiles per
// SM (e.g. 512 x 768 -> 3072, 384 x 1024 -> 4096, 512 x 2048 -> 2048); at 512 and 576 tiles the
// 128x128 configs or the fallback are as fast or faster. At K = 3072 and 4096 each tile's
// mainloop is long and cuBLAS splits K: 64x64 tiles ran at 1.04-1.24x of eager's speed up to one
// tile per SM (32..512 x 3072 -> 768, 32 and 256 x 4096 -> 1024; one tanh case at 32 rows
// 0.99x) and at 0.74-0.84x from 1.5 to 3 per SM (1024..2112 x 3072 -> 768, 1024 x 4096 -> 1024).
constexpr int64_t kSmallTilesPerSm = 3;
constexpr int64_t kSmallTilesPerSmLongK = 1;

bool small_enough_for_64x64(int64_t m, int64_t n, int64_t k, int sm_count) {
  const int64_t tiles_per_sm = k <= kLongK ? kSmallTilesPerSm : kSmallTilesPerSmLongK;
  return tile_count(m, n, 64, 64) <= tiles_per_sm * sm_count;
}

// The 128-column tiles that run a problem too big for 64x64 tiles: 128x128 up to kLongK, in
// clusters of two along the rows (the pair shares its weight loads), so an odd number of row
// tiles occupies one more; 256x128 past it, in clusters of two along the columns (the pair shares
// its activation loads), so an odd number of column tiles occupies one more. Where the extra row
// makes two waves of what fits one, the 128x128 tiles run without the cluster
// (kPingpong128x128Solo). Measured (H100, bf16 erf): the forward at 544..640 x 768 -> 3072,
// 14.7-14.8 us against 19.3-20.0 clustered; the backward GEMM with db from its epilogue at
// 544..640 x 768 -> 3072, 19.1-19.2 us against 24.2-24.4 clustered and 23.1-24.4 for its
// fallback.
struct BigTiles {
  Config config;
  int64_t tiles;     // tiles with work
  int64_t occupied;  // tiles the clusters occupy: the waves are counted in these
};

constexpr int kMinWaveFillPercent = 85;
// From this many waves on, the fused kernels take any problem: a poorly filled last wave is a
// small share of the call (size_refusal's comment).
constexpr int64_t kWavesAlwaysFused = 3;

// The waves the tiles run in: one occupied tile per SM at a time.
int64_t waves_of(const BigTiles& t, int sm_count) {
  return (t.occupied + sm_count - 1) / sm_count;
}

// Whether the tiles fill their waves to kMinWaveFillPercent.
bool fills_waves(const BigTiles& t, int sm_count) {
  return t.tiles * 100 >= kMinWaveFillPercent * waves_of(t, sm_count) * sm_count;
}

// Past kLongK, where the 256x128 tiles fill their waves poorly and unclustered 128x128 tiles fill
// theirs, the latter run (bench_linear_gelu.py --few-rows, H100, bf16 erf, us; unclustered
// 128x128 / 256x128 / the fallback or, where 256x128 ran fused, eager): 8192 x 3072 -> 768 60.5 /
// 77.6 / 68.6; 8192 x 4096 -> 768 76.1 / 98.5 / 83.5; 6144 x 4096 -> 1024 74.6 / 97.8 / 85.7;
// 2048 x 4096 -> 1024 32.6 / 47.9 / 35.6; 6144 x 3072 -> 1536 (256x128 three waves, 73% full, so
// fused) 97.0 / 111.1 / eager 95.6. Where both fill their waves, 256x128 stays (8192 x 4096 ->
// 1024 98.1 / 99.3; 8192 x 3072 -> 1536 118.9 / 112.6; 8192 x 4096 -> 16384 2259 / 1742); where
// neither does, so does the waves rule's fallback (unclustered 128x128 tiles 73% full: 6144 x
// 3072 -> 768 57.8 against the fallback's 52.9, 2048 x 3072 -> 1536 41.2 against 37.7). The
// 2x1-clustered 128x128 tiles lost to the unclustered ones at every shape past kLongK measured
// (69.6 against 60.5 at 8192 x 3072 -> 768) except 8192 x 4096 -> 16384 (2126.9 against 2258.7),
// where the 256x128 tiles run anyway, and won up to it (8192 x 1024 -> 4096 107.7 against 117.6,
// 8192 x 2048 -> 8192 424.6 against 509.0). The backward GEMM (dz + db, bench_mlp.py
// --few-rows, same order): 8192 x 3072 -> 768 67.2 / 91.8 / 79.0; 6144 x 4096 -> 1024 83.8 /
// 111.6 / 95.7; where both fill, 8192 x 4096 -> 1024, 108.1 / 113.7 (256x128 kept, as forward).

// The backward GEMM (dz + db) at 1024 < K <= 2048 and few rows ran faster on unclustered tiles at
// every row count measured, past one wave too (bench_mlp.py --few-rows, H100, 2048 -> 8192, solo
// against 2x1, us): 384 rows 43.0 / 45.4, 512 43.2 / 43.9, 576 54.8 / 58.4, 640 53.6 / 60.4, 768
// 54.4 / 54.9, 896 64.8 / 74.3, 1024 64.5 / 65.6, 1536 93.2 / 95.6. At K <= 1024 the two were
// within 2% of each other; more rows were not measured.
constexpr int64_t kBackwardSoloMaxRows = 1536;

bool backward_solo(bool backward, int64_t m, int64_t k) {
  return backward && k > kBackwardAnyFillMaxK && k <= kLongK && m <= kBackwardSoloMaxRows;
}

BigTiles big_tiles(int64_t m, int64_t n, int64_t k, int sm_count, bool solo = false) {
  const int64_t col_tiles = (n + 127) / 128;
  const int64_t row_tiles = (m + 127) / 128;
  const int64_t tiles = row_tiles * col_tiles;
  const BigTiles unpaired{Config::kPingpong128x128Solo, tiles, tiles};
  if (k > kLongK) {
    const int64_t coop_rows = (m + 255) / 256;
    const BigTiles coop{Config::kCoop256x128, coop_rows * col_tiles,
                        coop_rows * (col_tiles + col_tiles % 2)};
    return fills_waves(coop, sm_count) || !fills_waves(unpaired, sm_count) ? coop : unpaired;
  }
  const int64_t paired = (row_tiles + row_tiles % 2) * col_tiles;
  if (solo || (tiles <= sm_count && paired > sm_count)) return unpaired;
  return {Config::kPingpong128x128, tiles, paired};
}

}  // namespace

// The tile configuration for a problem shape (from benchmarks/bench_linear_gelu.py --sweep and
// --few-rows). Small problems: 64x64 tiles. Short K: each tile's mainloop is short, so the
// epilogue must run while the other warp group's mainloop does (ping-pong). Long K: the
// cooperative 256x128 tile reuses operands best.
Config choose_config(const Problem& p) {
  if (small_enough_for_64x64(p.m, p.n, p.k, p.sm_count)) return Config::kPingpong64x64;
  const bool solo = backward_solo(p.pass == Pass::kDgrad, p.m, p.k);
  return big_tiles(p.m, p.n, p.k, p.sm_count, solo).config;
}


Config auto_config(int64_t m, int64_t n, int64_t k, int sm_count, Pass pass) {
  Problem p;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.sm_count = sm_count;
  p.pass = pass;
  return choose_config(p);
}

// Measured (H100, 132 SMs, bf16 GELU, benchmarks/bench_linear_gelu.py --few-rows, 32..2048 rows at
// 768 -> 3072 and 1024 -> 4096; bench_mlp.py --few-rows for the backward GEMM): 64x64 tiles beat
// eager by 5-26% up to three tiles per SM (32..512 rows at 768 -> 3072, 32..384 at 1024 -> 4096);
// 128x128 tiles beat it by 7-17% where their waves are 97% full (128, 256, 384, 512 tiles) and lose
// by 2-8% at 55-73% (96, 144, 192 tiles); the fallback (cuBLAS + activation pass) is within 0-3% of
// eager. So the fused kernels take every problem small enough for 64x64 tiles or whose 128x128
// tiles fill 85% of their waves, and every problem of three waves or more. A one-kernel fallback
// (cuBLASLt's bias + ReLU epilogue) is as fast as the fused kernels or faster below three waves
// (bf16, same benchmark: 8.9-14.1 us against 10.0-14.8 with 64x64 tiles at 32..512 rows, 13.2
// against 14.8 at 512 x 1024 -> 4096, 18.6 against 19.0 at 1024 x 1024 -> 4096) and level or slower
// from there (2048 rows: 21.0 against 20.7 us; 8192 x 768 -> 3072: 63.1 against 58.5), so with it
// only three waves and more run fused. The 128x128 tiles run in clusters of two along the rows
// (2x1; 256x128: 1x2, along the columns), so an odd number of row (column) tiles occupies one more:
// 640 x 768 -> 3072 (5 x 24 tiles, 91% of a wave by count) ran as two waves, 18.8 us against
// eager's 16.0; without the cluster it runs as one (14.7-14.8 us at 544..640 rows, big_tiles). The
// waves are counted from the occupied tiles, their fill from the tiles with work. Past K = 2048 the
// big tiles are the cooperative kernel's 256x128, so they are counted as such: counted as 128x128
// they sent 2560 x 3072 -> 768 (120 tiles, 91% of a wave) to 60 cooperative tiles at 0.72x of
// eager's speed, 1920 x 4096 -> 1024 at 0.67x, and 8192 x 3072 -> 768 ("three waves") at 0.81x;
// counted as 256x128 they take the fallback (0.99-1.01x), and 4096 x 4096 -> 1024 (128 tiles, 97%)
// stays fused (0.98-1.01x, level with eager). The backward GEMM (kGemmAndGradPass) up to K = 1024
// is fused at every size: bench_mlp.py --few-rows, dz + db, the fused kernel against its fallback
// at 384..1536 rows: 768 -> 3072 17.2-31.4 us against 21.1-34.7 (544..640 rows on solo tiles:
// 19.1-19.2 against 23.1-24.4; 768 rows, 55% of two waves: 24.7 against 26.0), 1024 -> 4096
// 18.3-36.1 against 23.8-46.0. At K = 2048 it lost where the waves rule refuses it (384 x 2048 ->
// 8192, 73% of two waves: 45.4 against 41.6), so the rule stays there (kBackwardAnyFillMaxK).

const char* size_refusal(int64_t m, int64_t n, int64_t k, int sm_count, Fallback fallback) {
  // the 128-column tiles choose_config runs at this K: 128x128, or past kLongK 256x128 unless
  // unclustered 128x128 tiles fill their waves and those do not (big_tiles)
  const bool long_k = k > kLongK;
  // The backward GEMM's fallback is cuBLAS plus a pass over three hidden-sized tensors (da and z
  // read, dz written) that also sums db: at short K that pass costs more than a poorly filled
  // wave of the fused kernel's 128x128 tiles (db from their epilogue). See above for K.
  if (fallback == Fallback::kGemmAndGradPass && k <= kBackwardAnyFillMaxK) return nullptr;
  // Past kLongK cuBLASLt's bias + ReLU epilogue was as fast as the fused kernels or faster at
  // every size measured (bench_linear_gelu.py --few-rows, H100, bf16, us, cuBLASLt / the best
  // fused config): 2048..8192 x 3072 -> 768 20.9-55.8 / 23.8-58.4, 6144 x 4096 -> 1024 73.2 /
  // 71.8, 8192 x 4096 -> 1024 91.7 / 94.8, 6144 x 3072 -> 1536 79.4 / 91.2, 8192 x 3072 -> 1536
  // 107.3 / 110.0, 8192 x 4096 -> 16384 1705 / 1768.
  if (fallback == Fallback::kOneKernel && long_k)
    return "in_features over 2048, where the one-kernel fallback (cuBLASLt's GEMM + bias + "
           "ReLU) was as fast or faster at every size measured";
  const bool solo = backward_solo(fallback == Fallback::kGemmAndGradPass, m, k);
  const BigTiles big = big_tiles(m, n, k, sm_count, solo);
  const int64_t waves = waves_of(big, sm_count);
  if (waves >= kWavesAlwaysFused) return nullptr;
  if (fallback == Fallback::kOneKernel)
    return "fewer than three waves of 128x128 output tiles, where the one-kernel fallback "
           "(cuBLASLt's GEMM + bias + ReLU) is as fast or faster";
  if (small_enough_for_64x64(m, n, k, sm_count)) return nullptr;
  if (fills_waves(big, sm_count)) return nullptr;
  if (waves == 1)
    return long_k ? "more 64x64 output tiles than one per SM (in_features over 2048), fewer "
                    "256x128 tiles than 85% of the SMs, and 128x128 tiles that fill under 85% "
                    "of their waves (cuBLAS's GEMM is faster)"
                  : "more 64x64 output tiles than three per SM, and fewer 128x128 tiles than "
                    "85% of the SMs (cuBLAS's GEMM is faster)";
  return long_k ? "its 256x128 output tiles fill under 85% of their waves of one tile per SM, "
                  "and so do 128x128 ones (cuBLAS picks a tile shape that fills them)"
                : "its 128x128 output tiles fill under 85% of their waves of one tile per SM "
                  "(cuBLAS picks a tile shape that fills them)";
}

int64_t column_partial_rows(const Problem& p) {
  // (the output tile's rows, the warps of its epilogue: 2 x 4 in the cooperative kernel, one
  // warp group in the ping-pong ones)
  int tile_rows = 128, warps = 4;
  switch (p.config == Config::kAuto ? choose_config(p) : p.config) {
    case Config::kCoop256x128:
      tile_rows = 256;
      warps = 8;
      break;
    case Config::kPingpong64x64:
      tile_rows = 64;
      break;
    default:
      break;
  }
  return (int64_t{p.m} + tile_rows - 1) / tile_rows * warps;
}

namespace {

std::string str(int64_t v) { return std::to_string(v); }

std::string count_word(int64_t v) {
  static const char* const kWords[] = {"zero", "one", "two", "three", "four", "five"};
  return v >= 0 && v < 6 ? kWords[v] : str(v);
}

}  // namespace

std::string size_rule_text(Fallback fallback) {
  const std::string long_k = str(kLongK);
  const std::string fill = str(kMinWaveFillPercent) + "%";
  const std::string waves = count_word(kWavesAlwaysFused) + " waves and up";
  if (fallback == Fallback::kOneKernel)
    return waves + " of 128x128 output tiles (one tile per SM per wave), in_features up to " +
           long_k;
  std::string text = "outputs of at most " + count_word(kSmallTilesPerSm) +
                     " 64x64 tiles per SM (" + count_word(kSmallTilesPerSmLongK) + " past " +
                     long_k + " in_features) or whose 128x128 tiles (past " + long_k +
                     " in_features 256x128, or unpaired 128x128 where those fill their waves and "
                     "the 256x128 do not) fill their waves (one tile per SM) to " +
                     fill + " or more, or " + waves +
                     "; the waves counted from the pairs these tiles run in, along the rows for "
                     "128x128 and along the columns for 256x128 (an odd number of row or column "
                     "tiles occupies one more), except that 128x128 tiles that fit one wave "
                     "unpaired run unpaired";
  if (fallback == Fallback::kGemmAndGradPass)
    text += "; up to " + str(kBackwardAnyFillMaxK) +
            " in_features (of dy . W2) any number of rows; from " +
            str(kBackwardAnyFillMaxK + 1) + " to " + long_k + " in_features and up to " +
            str(kBackwardSoloMaxRows) + " rows the 128x128 tiles run unpaired";
  return text;
}

}  // namespace sm90
}  // namespace fastlayers
