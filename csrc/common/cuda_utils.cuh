// Device helpers shared by the CUDA op families: 16-byte vector loads/stores converting to
// and from float, and warp/block reductions whose result is bit-identical on every thread.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fastlayers {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// Whether a pointer can be read and written in 16-byte vectors (null counts as aligned).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int vec_of() {
  return 16 / static_cast<int>(sizeof(T));
}

// N contiguous elements of U as raw 16-byte words: held in registers at the storage width (half
// the registers of floats for 16-bit types) and converted where used.
template <typename U, int N>
struct RawVec {
  static constexpr int kPer = 16 / sizeof(U);
  static_assert(N % kPer == 0, "RawVec: N * sizeof(U) must be a multiple of 16 bytes");
  uint4 words[N / kPer];
};

template <typename U, int N>
__device__ __forceinline__ RawVec<U, N> load_raw(const U* p) {
  RawVec<U, N> r;
#pragma unroll
  for (int c = 0; c < N / RawVec<U, N>::kPer; ++c)
    r.words[c] = *reinterpret_cast<const uint4*>(p + c * RawVec<U, N>::kPer);
  return r;
}

// r's words, opaque to the compiler: floats unpacked from the result are computed again
// instead of kept live from an earlier unpacking of r (which would cost the registers that
// holding r raw saves: nvcc keeps a bfloat16 row's unpacked floats across a reduction).
template <typename U, int N>
__device__ __forceinline__ RawVec<U, N> opaque(RawVec<U, N> r) {
#pragma unroll
  for (int c = 0; c < N / RawVec<U, N>::kPer; ++c)
    asm volatile("" : "+r"(r.words[c].x), "+r"(r.words[c].y), "+r"(r.words[c].z),
                 "+r"(r.words[c].w));
  return r;
}

// The *_floats helpers convert to and from A: float, or double for float64 data (A deduced).
template <typename U, int N, typename A>
__device__ __forceinline__ void unpack_floats(const RawVec<U, N>& r, A (&out)[N]) {
  constexpr int kPer = RawVec<U, N>::kPer;
#pragma unroll
  for (int c = 0; c < N / kPer; ++c) {
    const U* e = reinterpret_cast<const U*>(&r.words[c]);
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[c * kPer + k] = static_cast<A>(e[k]);
  }
}

// Loads N contiguous elements of U starting at p (16-byte aligned) into floats.
template <typename U, int N, typename A>
__device__ __forceinline__ void load_floats(const U* p, A (&out)[N]) {
  unpack_floats<U, N>(load_raw<U, N>(p), out);
}

// N floats as U in registers, rounding to nearest even.
template <typename U, int N, typename A>
__device__ __forceinline__ RawVec<U, N> pack_floats(const A (&in)[N]) {
  constexpr int kPer = RawVec<U, N>::kPer;
  RawVec<U, N> r;
#pragma unroll
  for (int c = 0; c < N / kPer; ++c) {
    U* e = reinterpret_cast<U*>(&r.words[c]);
#pragma unroll
    for (int k = 0; k < kPer; ++k) e[k] = static_cast<U>(in[c * kPer + k]);
  }
  return r;
}

// Stores r's N elements at p (16-byte aligned): load_raw's inverse.
template <typename U, int N>
__device__ __forceinline__ void store_raw(U* p, const RawVec<U, N>& r) {
#pragma unroll
  for (int c = 0; c < N / RawVec<U, N>::kPer; ++c)
    *reinterpret_cast<uint4*>(p + c * RawVec<U, N>::kPer) = r.words[c];
}

// Stores N floats as U at p (16-byte aligned), rounding to nearest even.
template <typename U, int N, typename A>
__device__ __forceinline__ void store_floats(U* p, const A (&in)[N]) {
  store_raw<U, N>(p, pack_floats<U, N>(in));
}

// Count, mean and sum of squared deviations of a set of values (Chan et al. merge).
struct Moments {
  float n;
  float mean;
  float m2;
};

__device__ __forceinline__ Moments merge_moments(const Moments& a, const Moments& b) {
  const float n = a.n + b.n;
  if (n == 0.f) return a;
  const float wb = b.n / n;
  const float delta = b.mean - a.mean;
  return {n, fmaf(delta, wb, a.mean), a.m2 + b.m2 + delta * delta * a.n * wb};
}

// Merges across the 32 lanes; each pair merges (lower lane, higher lane) in that order, so
// every lane ends with the identical result.
__device__ __forceinline__ Moments warp_merge_moments(Moments m) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const Moments o{__shfl_xor_sync(kFullMask, m.n, off), __shfl_xor_sync(kFullMask, m.mean, off),
                    __shfl_xor_sync(kFullMask, m.m2, off)};
    m = (threadIdx.x & off) ? merge_moments(o, m) : merge_moments(m, o);
  }
  return m;
}

// Butterfly sum across the 32 lanes (float or double; addition is commutative, so all lanes
// agree).
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

}  // namespace cuda
}  // namespace fastlayers
