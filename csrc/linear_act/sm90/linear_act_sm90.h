// Interface of the sm_90a (Hopper) GEMMs of the Linear + activation family, built with CUTLASS 3:
// the fused forward (bias + activation epilogue) and the backward GEMM with the activation's
// derivative in its epilogue.
// Kept free of ATen and CUTLASS types: the CUTLASS translation units compile apart from torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/activation.h"

// cudaStream_t is a CUstream_st*; declared here so host C++ files need no CUDA headers.
struct CUstream_st;

namespace fastlayers {
namespace sm90 {

using Stream = CUstream_st*;

enum class Dtype : int { kHalf = 0, kBFloat16 = 1 };

// Tile/schedule configurations compiled in (kAuto picks by shape).
enum class Config : int {
  kAuto = -1,
  kCoop256x128 = 0,      // cooperative, 256x128x64 tile, cluster 1x2
  kPingpong128x128 = 1,  // ping-pong, 128x128x64 per warp group, cluster 2x1, 64x64 epilogue
  kPingpong64x64 = 2,    // ping-pong, 64x64x64 per warp group, no cluster: small problems
  // kPingpong128x128 without the cluster: one wave that pairs would make two, and past
  // in_features 2048 where the 256x128 tiles fill their waves poorly and these do not
  kPingpong128x128Solo = 3,
};
constexpr int kNumConfigs = 4;

// The name tests and benchmarks give each config (the raw entries' config argument is its
// number): _C._testing.sm90_tile_configs() reads them from here.
inline const char* config_name(Config config) {
  switch (config) {
    case Config::kCoop256x128:
      return "coop256x128";
    case Config::kPingpong128x128:
      return "pingpong128x128";
    case Config::kPingpong64x64:
      return "pingpong64x64";
    case Config::kPingpong128x128Solo:
      return "pingpong128x128solo";
    default:
      return "auto";
  }
}

// Which epilogue a GEMM runs (see linear_act_sm90.cuh).
enum class Pass : int {
  kForward = 0,  // y = act(x . W^T + bias), optionally preact = x . W^T + bias
  kDgrad = 1,    // y = act'(saved) * (x . W^T) (x: the incoming gradient)
  kForwardKeepDerivative = 2,  // kForward, preact = act'(x . W^T + bias) (GELU; an MLP's forward)
};

// kForward: y[m, n] = act(x[m, k] . W^T + bias[n]) (Activation::kIdentity, for benchmarks only,
// isolates the GEMM from the activation's cost); W is w[n, k] row-major, or w[k, n] row-major when
// w_transposed (HuggingFace Conv1D's layout). Every pointer 16-byte aligned, k and n multiples
// of 8. preact, when not null, receives z = x W^T + bias rounded to the output dtype (act'(z) in
// kForwardKeepDerivative, whose sizes and tiles are kForward's).
// kDgrad: y[m, n] = activation_grad(x[m, k] . W^T, saved[m, n]) (saved: z for GELU, the forward
// output for ReLU, act'(z) for Activation::kSavedDerivative; bias and preact unused);
// col_partials, when not null, receives for each row tile the column sums of y in float before
// rounding, one row per warp of the tile's epilogue (column_partial_rows(p) rows of n).
struct Problem {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;  // may be null
  void* y = nullptr;
  void* preact = nullptr;  // may be null
  const void* saved = nullptr;  // kDgrad
  float* col_partials = nullptr;  // kDgrad, may be null: [column_partial_rows, n]
  // kDgrad: y = act(saved) * (x . W^T) instead, each factor rounded to the dtype first (a gated
  // MLP's up projection with its product, saved = the gate projection's output; epilogue = the
  // gate's activation: kSiLU or kGeluTanh)
  bool gated = false;
  Pass pass = Pass::kForward;
  int m = 0, n = 0, k = 0;
  bool w_transposed = false;
  Activation epilogue = Activation::kGeluErf;
  Config config = Config::kAuto;
  int device = 0;
  int sm_count = 0;
};

// Entry points of one compiled kernel (null where that kernel is not compiled in).
struct Launcher {
  size_t (*workspace_bytes)(const Problem&) = nullptr;
  const char* (*run)(const Problem&, void*, Stream) = nullptr;
};

// One per (pass, dtype, weight layout), each defined in its own file
// linear_act_sm90_[dgrad_]<dtype>_<layout>.cu (n: w [n, k]; t: w stored transposed, [k, n]);
// empty where the kernels are not compiled in.
Launcher launcher_bf16_n(Config config);
Launcher launcher_bf16_t(Config config);
Launcher launcher_fp16_n(Config config);
Launcher launcher_fp16_t(Config config);
Launcher dgrad_launcher_bf16_n(Config config);
Launcher dgrad_launcher_bf16_t(Config config);
Launcher dgrad_launcher_fp16_n(Config config);
Launcher dgrad_launcher_fp16_t(Config config);
Launcher keep_launcher_bf16_n(Config config);
Launcher keep_launcher_bf16_t(Config config);
Launcher keep_launcher_fp16_n(Config config);
Launcher keep_launcher_fp16_t(Config config);

// Defines `Launcher NAME(Config)` of one instantiation file: the kernels of (ELEMENT, TRANSPOSED,
// PASS) where this build compiles the sm_90a CUTLASS kernels (the file then includes
// linear_act_sm90.cuh), else an empty launcher (the arguments are not even read).
#ifndef FASTLAYERS_WITH_CUTLASS_SM90
#define FASTLAYERS_WITH_CUTLASS_SM90 0
#endif
#if FASTLAYERS_WITH_CUTLASS_SM90
#define FASTLAYERS_SM90_LAUNCHER(NAME, ELEMENT, TRANSPOSED, PASS) \
  Launcher NAME(Config config) { return launcher_for<ELEMENT, TRANSPOSED, PASS>(config); }
#else
#define FASTLAYERS_SM90_LAUNCHER(NAME, ELEMENT, TRANSPOSED, PASS) \
  Launcher NAME(Config) { return {}; }
#endif

// Output tiles of tile_m x tile_n covering an m x n output (partial tiles counted).
inline int64_t tile_count(int64_t m, int64_t n, int64_t tile_m, int64_t tile_n) {
  return ((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n);
}

// Whether the sm_90a kernels were compiled into this build.
bool kernels_built();

// What a call runs when the fused kernels do not take it: a cuBLAS GEMM and an activation pass,
// one kernel that does both (cuBLASLt's GEMM + bias + ReLU epilogue), or, for the backward GEMM,
// a cuBLAS GEMM and the backward pass that writes dz and sums the bias gradient in one go.
enum class Fallback : int { kGemmAndPass = 0, kOneKernel = 1, kGemmAndGradPass = 2 };

// Why an m x n output with inner dimension k should not run on the fused kernels of a GPU with
// sm_count SMs, given the fallback (nullptr: it should): their persistent grids run whole waves
// of output tiles, one per SM at a time, so a poorly filled wave costs as much as a full one,
// where cuBLAS picks its tile (and splits k) per problem.
const char* size_refusal(int64_t m, int64_t n, int64_t k, int sm_count, Fallback fallback);

// The tile configuration kAuto picks for p's shape, pass and SM count (size_rule.cpp), and the same
// for an m x n x k problem of pass on a GPU with sm_count SMs.
Config choose_config(const Problem& p);
Config auto_config(int64_t m, int64_t n, int64_t k, int sm_count, Pass pass);

// The problems size_refusal lets the fused kernels take, given the fallback, in words (for
// `python -m fastlayers env`; built from the rule's own constants).
std::string size_rule_text(Fallback fallback);

// Whether config is compiled for this pass, dtype and weight layout (kAuto always is, when
// built).
bool config_available(Pass pass, Dtype dtype, bool w_transposed, Config config);

// Rows of the kDgrad column partial sums for p (its config's, or kAuto's choice): one per warp of
// each row tile's epilogue.
int64_t column_partial_rows(const Problem& p);

// Device workspace the kernel needs (bytes; may be 0).
size_t workspace_bytes(Dtype dtype, const Problem& p);

// Launches on stream. Returns nullptr on success, else a message saying what failed.
const char* run(Dtype dtype, const Problem& p, void* workspace, Stream stream);

}  // namespace sm90
}  // namespace fastlayers
