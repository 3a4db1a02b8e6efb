// Counter-based random numbers for dropout masks, identical on CPU and CUDA.
//
// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011): a pure function of a 64-bit key and a 128-bit counter. The mask of element e of a
// call is a function of (seed, offset, e) only, so the backward regenerates the forward's mask
// instead of storing it, any thread layout draws the same mask, and a CPU call given the same
// (seed, offset) draws the CUDA call's mask.
//
// Counter layout, as curand_init(seed, subsequence = e / 4, offset) followed by one curand4()
// (what ATen's fused dropout draws from): counter = (offset / 4 in the low 64 bits, e / 4 in
// the high 64 bits), key = seed; element e takes word e % 4. A call therefore consumes 4 of the
// generator's offset units (philox_cuda_state(4)), never overlapping another call's counters.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FASTLAYERS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTLAYERS_HOST_DEVICE inline
#endif

namespace fastlayers {
namespace philox {

struct Words {
  uint32_t w[4];
};

FASTLAYERS_HOST_DEVICE void mul_hi_lo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

// The four 32-bit words for counter group `group` of a call with (seed, offset).
FASTLAYERS_HOST_DEVICE Words random4(uint64_t seed, uint64_t offset, uint64_t group) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  const uint64_t lo = offset / 4;
  uint32_t c0 = static_cast<uint32_t>(lo), c1 = static_cast<uint32_t>(lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(group), c3 = static_cast<uint32_t>(group >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kMul0, c0, hi0, lo0);
    mul_hi_lo(kMul1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Words{{c0, c1, c2, c3}};
}

// Element e is kept when its word is below keep_threshold(p): probability (1 - p) up to 2^-32.
inline uint32_t keep_threshold(double p) {
  const double keep = (1.0 - p) * 4294967296.0;  // (1 - p) * 2^32
  if (keep <= 0.0) return 0u;                     // p = 1: nothing kept
  if (keep >= 4294967295.0) return 0xFFFFFFFFu;
  return static_cast<uint32_t>(keep);
}

FASTLAYERS_HOST_DEVICE bool keep(uint64_t seed, uint64_t offset, uint64_t e, uint32_t threshold) {
  return random4(seed, offset, e / 4).w[e % 4] < threshold;
}

}  // namespace philox
}  // namespace fastlayers
