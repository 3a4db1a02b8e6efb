// Device helpers shared by the CUDA op families: 16-byte vector loads/stores converting to
// and from float, and warp/block reductions whose result is bit-identical on every thread.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

// unpack_floats by 32-bit word: a bfloat16 is a float32's high half, so each element is one
// shift or mask of its word (c10's conversion extracts each half first: a PRMT and a shift for
// every high lane). The same values; other types as unpack_floats. Used by the row norms'
// forward kernel (sm_90a, bf16 LayerNorm: 56 -> 48 registers at 32 x 4 vectors, faster). Not
// the default, measured elsewhere: the row norms' backwards got more registers (64 -> 80, or
// spills) and the rotary kernel, 64 -> 48 registers, ran 12% slower (H200, Llama-3-8B shape).
template <typename U, int N, typename A>
__device__ __forceinline__ void unpack_floats_by_word(const RawVec<U, N>& r, A (&out)[N]) {
  if constexpr (std::is_same_v<U, c10::BFloat16> && std::is_same_v<A, float>) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(r.words);
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      out[2 * j] = __uint_as_float(w[j] << 16);
      out[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  } else {
    unpack_floats<U, N>(r, out);
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

// Two lanes of a 16-bit T (float16 or bfloat16) in one 32-bit word, and T's own correctly
// rounded two-lane operations (sm_90: mul.rn / add.rn / sub.rn, never contracted into an FMA;
// sm_80: cuda_bf16.hpp's fma.rn with a -0 / +-1 operand, the same results). Each equals the
// float32 op rounded to T, which is what ATen's half-precision kernels compute: a product of two
// values of T is exact in float32 (bfloat16 products under 2^-126 are rounded to float32's
// subnormal step, 16 bits finer than bfloat16's, which changes no rounding to bfloat16; products
// over float32's range are inf either way), and rounding a float32 sum of two values of T to T
// rounds once in effect (float32's 24 bits are at least 2p + 2 for T's p = 8 or 11, so the
// double rounding is innocuous). NaN payloads may differ (canonical NaNs either way).
template <typename T>
struct Lanes;

template <>
struct Lanes<c10::BFloat16> {
  using V = __nv_bfloat162;
  static __device__ __forceinline__ V from_floats(float lo, float hi) {
    return __floats2bfloat162_rn(lo, hi);
  }
};

template <>
struct Lanes<c10::Half> {
  using V = __half2;
  static __device__ __forceinline__ V from_floats(float lo, float hi) {
    return __floats2half2_rn(lo, hi);
  }
};

template <typename T>
__device__ __forceinline__ typename Lanes<T>::V as_lanes(uint32_t w) {
  typename Lanes<T>::V v;
  *reinterpret_cast<uint32_t*>(&v) = w;
  return v;
}

template <typename T>
__device__ __forceinline__ uint32_t as_word(typename Lanes<T>::V v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  return as_word<T>(__hmul2_rn(as_lanes<T>(a), as_lanes<T>(b)));
}

template <typename T>
__device__ __forceinline__ uint32_t add2(uint32_t a, uint32_t b) {
  return as_word<T>(__hadd2_rn(as_lanes<T>(a), as_lanes<T>(b)));
}

template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  return as_word<T>(__hsub2_rn(as_lanes<T>(a), as_lanes<T>(b)));
}

// (lo, hi) rounded to T (nearest even), lo in the low lane.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return as_word<T>(Lanes<T>::from_floats(lo, hi));
}

__device__ __forceinline__ uint32_t swap_lanes(uint32_t w) { return __byte_perm(w, 0, 0x1032); }

// The 32-bit words of a RawVec (4 per 16-byte vector), as one array.
template <typename U, int N>
__device__ __forceinline__ uint32_t* words_of(RawVec<U, N>& r) {
  return reinterpret_cast<uint32_t*>(r.words);
}

template <typename U, int N>
__device__ __forceinline__ const uint32_t* words_of(const RawVec<U, N>& r) {
  return reinterpret_cast<const uint32_t*>(r.words);
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
