// Rotary embedding CUDA kernels: q and k (forward), or their grads (backward), rotated in ONE
// launch, rounding as rotary.h states (float32 arithmetic, rounded to the op's result dtype after
// each multiply and add, never contracted into an FMA: ATen's CUDA mul/add kernels, op for op;
// where every op rounds to q's 16-bit dtype, that dtype's own two-lane ops, the same bits:
// packed_unit).
//
// What the kernels take (else the ATen composite of rotary.cpp runs on the GPU, same results):
// 4-D q and k (or grads) with a contiguous last dim and any other strides (transposed views of a
// [B, S, H*D] projection, slices of a fused qkv projection); cos and sin with a contiguous last
// dim, broadcast (stride 0) over the dims where cos.unsqueeze(unsqueeze_dim) has size 1, never
// enlarging q or k; Dr = cos.size(-1) even (== D unless kRotaryPartial, then <= D); dtypes
// (q, cos, out) in (float, float, float) or, for T half or bfloat16, (T, T, T), (T, float, float)
// and (T, float, T) (the backward reads grads of the out dtype and writes T). Upcast without
// cast-back under a half cos ((T, T, float): no model's form) runs the composite.
//
// Work: each of the two tensors is rows (its three leading dims, ordered outermost to innermost
// by its input's strides, so consecutive threads walk memory in order: (B, S, H) for the
// transposed projection) of `per_row` units; a unit rotates pairs, or copies the pass-through
// part. Virtual blocks of kThreads units: q's first, then k's (block-uniform choice); a
// grid-stride loop over them. Vectorized (16 bytes of q's dtype per load) where every pointer,
// stride and the rotary half allow, per tensor (block-uniform), else element pairs.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "common/arch_check.h"
#include "common/common.h"
#include "common/cuda_utils.cuh"
#include "rotary/rotary.h"

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.rotary";
constexpr int kThreads = 256;
constexpr int kBlocksPerSM = 8;  // 2048 threads: a full SM; the grid-stride loop does the rest

bool has(int64_t form, int64_t flag) { return (form & flag) != 0; }

using Divider = at::cuda::detail::IntDivider<uint32_t>;

// One tensor's work (q's or k's; in the backward, grad_q's or grad_k's). Offsets are in
// elements; strides are those of the three leading dims in iteration order (outermost first),
// cos's and sin's 0 where they broadcast.
struct Side {
  const void* in;  // x (forward) or its grad (backward)
  void* out;
  const void* cos;
  const void* sin;
  int64_t in_stride[3], out_stride[3], cos_stride[3], sin_stride[3];
  Divider per_row, n2, n1;  // units a row; the sizes of the inner and middle leading dims
  uint32_t units;           // rows * per_row
  uint32_t blocks;          // virtual blocks: ceil(units / kThreads)
  int32_t rot_units;        // the first rot_units units of a row rotate, the rest pass through
  int32_t half;             // h = Dr / 2
  int32_t dr;               // Dr: where the pass-through part starts
  bool vec;                 // 16-byte vectors (else element pairs)
};

// The form, as the kernels use it. round_c: C (the dtype of r * c) is q's half dtype, so each
// forward op (and each backward product) rounds to it; round_x: X (the dtype the backward sums
// in) is q's half dtype.
struct KernelForm {
  bool interleaved, round_c, round_x;
};

struct Params {
  Side side[2];  // q, k
  KernelForm form;
  uint32_t total_blocks;  // side[0].blocks + side[1].blocks
};

// v rounded to T (when `on`) and widened back: one op's result in T.
template <typename T>
__device__ __forceinline__ float rnd(float v, bool on) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return on ? static_cast<float>(static_cast<T>(v)) : v;
  }
}

template <typename U, int N>
__device__ __forceinline__ void load_n(const U* p, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = static_cast<float>(*p);
  } else {
    cuda::load_floats<U, N>(p, out);
  }
}

template <typename U, int N>
__device__ __forceinline__ void store_n(U* p, const float (&in)[N]) {
  if constexpr (N == 1) {
    *p = static_cast<U>(in[0]);
  } else {
    cuda::store_floats<U, N>(p, in);
  }
}

// One rotated pair (a, b): rotate(r)[a] = -r[b], rotate(r)[b] = r[a] (rotate_half: b = a + h;
// interleaved: a = 2j, b = 2j + 1).
//   forward:  ya = rnd_C(rnd_C(ra * ca) - rnd_C(rb * sa)),
//             yb = rnd_C(rnd_C(rb * cb) + rnd_C(ra * sb))
//   backward: da = rnd_X(rnd_X(rnd_C(ga * ca)) + rnd_X(rnd_C(gb * sb))),
//             db = rnd_X(rnd_X(rnd_C(gb * cb)) - rnd_X(rnd_C(ga * sa)))
// (rnd_C(-p) = -rnd_C(p) and x + (-y) = x - y exactly, so negating rotate's operand first, as
// the models do, changes nothing.)
template <typename T, bool kBwd>
__device__ __forceinline__ void pair(float ra, float rb, float ca, float cb, float sa, float sb,
                                     const KernelForm& f, float& ya, float& yb) {
  const bool rc = f.round_c;
  if constexpr (kBwd) {
    const bool rx = f.round_x;
    const float t1a = rnd<T>(rnd<T>(__fmul_rn(ra, ca), rc), rx);
    const float t1b = rnd<T>(rnd<T>(__fmul_rn(rb, cb), rc), rx);
    const float t2a = rnd<T>(rnd<T>(__fmul_rn(rb, sb), rc), rx);
    const float t2b = rnd<T>(rnd<T>(__fmul_rn(ra, sa), rc), rx);
    ya = rnd<T>(__fadd_rn(t1a, t2a), rx);
    yb = rnd<T>(__fsub_rn(t1b, t2b), rx);
  } else {
    ya = rnd<T>(__fsub_rn(rnd<T>(__fmul_rn(ra, ca), rc), rnd<T>(__fmul_rn(rb, sa), rc)), rc);
    yb = rnd<T>(__fadd_rn(rnd<T>(__fmul_rn(rb, cb), rc), rnd<T>(__fmul_rn(ra, sb), rc)), rc);
  }
}

// The packed path. Where q, cos and the output share a 16-bit dtype T and every op rounds to T
// (no upcast), cuda::mul2 / add2 / sub2 (T's own correctly rounded two-lane ops: cuda_utils.cuh
// says why they equal float32-then-T) compute the same bits on raw words: two elements an
// instruction and no conversions.
constexpr uint32_t kNegLow = 0x00008000u, kNegHigh = 0x80000000u;  // a lane's sign bit

// A vector unit (pair() per element, the same roundings) on 16-byte words of T: rotate_half's
// pairs across the two vectors (a word of each), the interleaved form's within each word (lanes
// (r[2j], r[2j + 1])): forward y = r * c + swap(r) * (-s_lo, s_hi), backward
// d = g * c + swap(g) * (s_hi, -s_lo), the negation applied to the exact-sign product instead.
template <typename T, bool kBwd>
__device__ __forceinline__ void packed_unit(const T* x, T* y, const T* c, const T* s, int32_t a,
                                            int32_t b, bool interleaved) {
  using cuda::add2, cuda::mul2, cuda::sub2, cuda::swap_lanes, cuda::words_of;
  constexpr int kVec = cuda::vec_of<T>();
  using Raw = cuda::RawVec<T, kVec>;
  const Raw xa = cuda::load_raw<T, kVec>(x + a), xb = cuda::load_raw<T, kVec>(x + b);
  const Raw ca = cuda::load_raw<T, kVec>(c + a), cb = cuda::load_raw<T, kVec>(c + b);
  const Raw sa = cuda::load_raw<T, kVec>(s + a), sb = cuda::load_raw<T, kVec>(s + b);
  Raw ya, yb;
  // one vector's words (the interleaved form: its pairs within each word)
  const auto within = [](const uint32_t* r, const uint32_t* cw, const uint32_t* sw, uint32_t* o) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (kBwd) {
        const uint32_t cross = mul2<T>(swap_lanes(r[w]), swap_lanes(sw[w])) ^ kNegHigh;
        o[w] = add2<T>(mul2<T>(r[w], cw[w]), cross);
      } else {
        o[w] = add2<T>(mul2<T>(r[w], cw[w]), mul2<T>(swap_lanes(r[w]), sw[w]) ^ kNegLow);
      }
    }
  };
  if (interleaved) {
    within(words_of(xa), words_of(ca), words_of(sa), words_of(ya));
    within(words_of(xb), words_of(cb), words_of(sb), words_of(yb));
  } else {
    const uint32_t *ra = words_of(xa), *rb = words_of(xb);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t ca_w = words_of(ca)[w], cb_w = words_of(cb)[w];
      const uint32_t sa_w = words_of(sa)[w], sb_w = words_of(sb)[w];
      if constexpr (kBwd) {
        words_of(ya)[w] = add2<T>(mul2<T>(ra[w], ca_w), mul2<T>(rb[w], sb_w));
        words_of(yb)[w] = sub2<T>(mul2<T>(rb[w], cb_w), mul2<T>(ra[w], sa_w));
      } else {
        words_of(ya)[w] = sub2<T>(mul2<T>(ra[w], ca_w), mul2<T>(rb[w], sa_w));
        words_of(yb)[w] = add2<T>(mul2<T>(rb[w], cb_w), mul2<T>(ra[w], sb_w));
      }
    }
  }
  cuda::store_raw<T, kVec>(y + a, ya);
  cuda::store_raw<T, kVec>(y + b, yb);
}

// One unit of side s: N = 1 rotates one pair (or copies one element); N = the vector width
// rotates 2N elements (rotate_half: N at a and N at a + h; interleaved: 2N contiguous ones, pairs
// within each vector), or copies N. T: q's dtype; In, Out: what the side reads and writes.
template <typename T, typename U, typename In, typename Out, int N, bool kBwd>
__device__ __forceinline__ void rotary_unit(const Side& s, const KernelForm& f, uint32_t u) {
  const auto rc = s.per_row.divmod(u);
  const auto r2 = s.n2.divmod(rc.div);
  const auto r1 = s.n1.divmod(r2.div);
  const int64_t i0 = r1.div, i1 = r1.mod, i2 = r2.mod;
  const In* x = static_cast<const In*>(s.in) + i0 * s.in_stride[0] + i1 * s.in_stride[1] +
                i2 * s.in_stride[2];
  Out* y = static_cast<Out*>(s.out) + i0 * s.out_stride[0] + i1 * s.out_stride[1] +
           i2 * s.out_stride[2];
  const int32_t col = static_cast<int32_t>(rc.mod);
  if (col >= s.rot_units) {  // the pass-through part: copied, cast to Out
    const int32_t e = s.dr + (col - s.rot_units) * N;
    float v[N];
    load_n<In, N>(x + e, v);
    store_n<Out, N>(y + e, v);
    return;
  }
  const U* c = static_cast<const U*>(s.cos) + i0 * s.cos_stride[0] + i1 * s.cos_stride[1] +
               i2 * s.cos_stride[2];
  const U* sn = static_cast<const U*>(s.sin) + i0 * s.sin_stride[0] + i1 * s.sin_stride[1] +
                i2 * s.sin_stride[2];
  // Pairs across the two loads (rotate_half, or any form one pair at a time) or within each.
  const bool within = N > 1 && f.interleaved;
  int32_t a, b;
  if (f.interleaved) {
    a = col * 2 * N;
    b = a + N;
  } else {
    a = col * N;
    b = a + s.half;
  }
  if constexpr (N > 1 && !std::is_same_v<T, float> && std::is_same_v<U, T> &&
                std::is_same_v<In, T> && std::is_same_v<Out, T>) {
    if (f.round_c) {  // every op rounds to T: T's packed ops (above)
      packed_unit<T, kBwd>(x, y, c, sn, a, b, f.interleaved);
      return;
    }
  }
  float xa[N], xb[N], ca[N], cb[N], sa[N], sb[N], ya[N], yb[N];
  load_n<In, N>(x + a, xa);
  load_n<In, N>(x + b, xb);
  load_n<U, N>(c + a, ca);
  load_n<U, N>(c + b, cb);
  load_n<U, N>(sn + a, sa);
  load_n<U, N>(sn + b, sb);
  if (within) {
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      pair<T, kBwd>(xa[j], xa[j + 1], ca[j], ca[j + 1], sa[j], sa[j + 1], f, ya[j], ya[j + 1]);
      pair<T, kBwd>(xb[j], xb[j + 1], cb[j], cb[j + 1], sb[j], sb[j + 1], f, yb[j], yb[j + 1]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      pair<T, kBwd>(xa[j], xb[j], ca[j], cb[j], sa[j], sb[j], f, ya[j], yb[j]);
    }
  }
  store_n<Out, N>(y + a, ya);
  store_n<Out, N>(y + b, yb);
}

// T: q's dtype, U: cos's, O: the forward output's (the backward's grads arrive in O and leave
// in T). Blocks [0, side[0].blocks) of the virtual grid do q, the rest k.
template <typename T, typename U, typename O, bool kBwd>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const __grid_constant__ Params p) {
  using In = std::conditional_t<kBwd, O, T>;
  using Out = std::conditional_t<kBwd, T, O>;
  constexpr int kVec = cuda::vec_of<T>();
  const uint32_t q_blocks = p.side[0].blocks;
  for (uint32_t vb = blockIdx.x; vb < p.total_blocks; vb += gridDim.x) {
    const bool is_k = vb >= q_blocks;
    const Side& s = p.side[is_k ? 1 : 0];
    const uint32_t u = (vb - (is_k ? q_blocks : 0u)) * kThreads + threadIdx.x;
    if (u >= s.units) continue;
    if (s.vec) {
      rotary_unit<T, U, In, Out, kVec, kBwd>(s, p.form, u);
    } else {
      rotary_unit<T, U, In, Out, 1, kBwd>(s, p.form, u);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

// The dtype triple (q, cos, out) of a call, as the kernels are instantiated for it.
enum class Mix { kNone, kSame, kFloatCos, kFloatCosCastBack };

Mix mix_of(at::ScalarType q, at::ScalarType c, at::ScalarType o) {
  if (q != at::kFloat && q != at::kHalf && q != at::kBFloat16) return Mix::kNone;
  if (c == q && o == q) return Mix::kSame;                     // (T, T, T), (float, float, float)
  if (c == at::kFloat && o == at::kFloat) return Mix::kFloatCos;   // (T, float, float)
  if (c == at::kFloat && o == q) return Mix::kFloatCosCastBack;    // (T, float, T)
  return Mix::kNone;
}

// f(TypeTag<T>, TypeTag<U>, TypeTag<O>) for a mix other than kNone.
template <typename F>
void dispatch_mix(at::ScalarType q, Mix mix, F&& f) {
  dispatch_dtype(q, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (mix == Mix::kSame) {
      f(tag, tag, tag);
    } else if constexpr (!std::is_same_v<T, float>) {
      if (mix == Mix::kFloatCos) {
        f(tag, TypeTag<float>{}, TypeTag<float>{});
      } else {
        f(tag, TypeTag<float>{}, tag);
      }
    }
  });
}

// x's (q's, k's or a grad's) rows as the kernel walks them, and cos's and sin's strides for
// them: nullopt where the kernel does not take x.
struct Geometry {
  int64_t size[3];  // iteration order, outermost first
  int64_t in_stride[3], cos_stride[3], sin_stride[3];
  int perm[3];  // x's dim of each iteration dim
  int64_t d, dr;
};

std::optional<Geometry> geometry(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s,
                                 int64_t form) {
  if (x.dim() != 4 || c.dim() > 4) return std::nullopt;
  Geometry g;
  g.d = x.size(3);
  g.dr = c.size(-1);
  const bool partial = has(form, kRotaryPartial);
  if (g.dr < 2 || g.dr % 2 != 0 || (partial ? g.dr > g.d : g.dr != g.d)) return std::nullopt;
  if (x.stride(3) != 1 || c.stride(-1) != 1 || s.stride(-1) != 1) return std::nullopt;
  int64_t size[3], xs[3], cs[3], ss[3];
  const int64_t lead = c.dim() - 4;  // c's dim i + lead aligns with x's dim i (right-aligned)
  for (int i = 0; i < 3; ++i) {
    size[i] = x.size(i);
    xs[i] = x.stride(i);
    const int64_t ci = i + lead;
    const int64_t cn = ci < 0 ? 1 : c.size(ci);
    if (cn != 1 && cn != size[i]) return std::nullopt;  // cos would enlarge x (or not broadcast)
    cs[i] = cn == 1 ? 0 : c.stride(ci);
    ss[i] = cn == 1 ? 0 : s.stride(ci);
  }
  // Outermost first: size-1 dims (where they go does not matter), then by x's stride, largest
  // first, so consecutive units walk x's memory in order.
  int perm[3] = {0, 1, 2};
  const auto key = [&](int i) {
    return size[i] == 1 ? std::numeric_limits<int64_t>::max() : xs[i];
  };
  std::stable_sort(perm, perm + 3, [&](int a, int b) { return key(a) > key(b); });
  for (int i = 0; i < 3; ++i) {
    g.perm[i] = perm[i];
    g.size[i] = size[perm[i]];
    g.in_stride[i] = xs[perm[i]];
    g.cos_stride[i] = cs[perm[i]];
    g.sin_stride[i] = ss[perm[i]];
  }
  return g;
}

// The units of x's rows, or nullopt where they exceed the kernel's 32-bit unit index.
std::optional<int64_t> unit_count(const Geometry& g, bool vec, int vec_width) {
  const int64_t w = vec ? vec_width : 1;
  const int64_t per_row = g.dr / (2 * w) + (g.d - g.dr) / w;
  const int64_t rows = g.size[0] * g.size[1] * g.size[2];
  // the per-row count bounds the product first (no overflow in rows * per_row)
  if (rows > 0 && per_row > std::numeric_limits<int32_t>::max() / rows) return std::nullopt;
  return rows * per_row;
}

// Whether 16-byte vectors of vec_width elements (q's dtype) serve every operand of x's rows.
bool vectorizes(const Geometry& g, const at::Tensor& in, const at::Tensor& out,
                const at::Tensor& c, const at::Tensor& s, int64_t form, int vec_width) {
  const int64_t w = vec_width;
  // a unit's two vectors: at a and a + h (rotate_half), or 2w contiguous elements (interleaved)
  if (has(form, kRotaryInterleaved) ? g.dr % (2 * w) != 0 : (g.dr / 2) % w != 0) return false;
  if ((g.d - g.dr) % w != 0) return false;
  for (const void* p : {in.data_ptr(), out.data_ptr(), c.data_ptr(), s.data_ptr()}) {
    if (!cuda::aligned16(p)) return false;
  }
  for (int i = 0; i < 3; ++i) {
    if (g.size[i] == 1) continue;
    const int64_t os = out.stride(g.perm[i]);
    if (g.in_stride[i] % w || os % w || g.cos_stride[i] % w || g.sin_stride[i] % w) return false;
  }
  return true;
}

// Side for x's rows (in: x or its grad, out: the result, of x's shape).
template <typename T>
Side make_side(const Geometry& g, const at::Tensor& in, const at::Tensor& out,
               const at::Tensor& c, const at::Tensor& s, int64_t form) {
  constexpr int kVec = cuda::vec_of<T>();
  Side side{};
  side.in = in.data_ptr();
  side.out = out.data_ptr();
  side.cos = c.data_ptr();
  side.sin = s.data_ptr();
  side.vec = vectorizes(g, in, out, c, s, form, kVec);
  const int64_t w = side.vec ? kVec : 1;
  const int64_t per_row = g.dr / (2 * w) + (g.d - g.dr) / w;
  const int64_t units = *unit_count(g, side.vec, kVec);  // checked in kernels_take
  for (int i = 0; i < 3; ++i) {
    side.in_stride[i] = g.in_stride[i];
    side.out_stride[i] = out.stride(g.perm[i]);
    side.cos_stride[i] = g.cos_stride[i];
    side.sin_stride[i] = g.sin_stride[i];
  }
  side.per_row = Divider(static_cast<uint32_t>(per_row));
  side.n2 = Divider(static_cast<uint32_t>(std::max<int64_t>(g.size[2], 1)));
  side.n1 = Divider(static_cast<uint32_t>(std::max<int64_t>(g.size[1], 1)));
  side.units = static_cast<uint32_t>(units);
  side.blocks = static_cast<uint32_t>((units + kThreads - 1) / kThreads);
  side.rot_units = static_cast<int32_t>(g.dr / (2 * w));
  side.half = static_cast<int32_t>(g.dr / 2);
  side.dr = static_cast<int32_t>(g.dr);
  return side;
}

// A side with no work (an absent grad).
Side empty_side() {
  Side side{};
  side.per_row = side.n2 = side.n1 = Divider(1);
  return side;
}

// Whether the kernels take x (its geometry exists, and its units, counted as element pairs,
// the larger count, fit the 32-bit unit index with the virtual blocks' round-up).
bool kernels_take(const std::optional<Geometry>& g) {
  if (!g) return false;
  if (g->d > std::numeric_limits<int32_t>::max()) return false;
  const auto units = unit_count(*g, false, 1);
  return units && *units <= std::numeric_limits<int32_t>::max() - kThreads;
}

KernelForm kernel_form(at::ScalarType q, at::ScalarType c, int64_t form) {
  const bool half = q != at::kFloat;
  const bool upcast = has(form, kRotaryUpcast);
  return {has(form, kRotaryInterleaved), half && !upcast && c == q,
          half && !(upcast && !has(form, kRotaryUpcastEach))};
}

template <typename T, typename U, typename O, bool kBwd>
void launch(Params& p) {
  p.total_blocks = p.side[0].blocks + p.side[1].blocks;
  if (p.total_blocks == 0) return;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t grid = std::min<int64_t>(p.total_blocks, sms * kBlocksPerSM);
  rotary_kernel<T, U, O, kBwd>
      <<<static_cast<unsigned>(grid), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}


bool present(const std::optional<at::Tensor>& g) { return g.has_value() && g->defined(); }

}  // namespace

RotaryPair rotary_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form) {
  check_rotary_args(q, k, cos, sin, unsqueeze_dim, form);
  const c10::cuda::CUDAGuard guard(q.device());
  check_kernel_image(q.get_device(), kOp);
  const at::ScalarType out_dtype = rotary_out_dtype(q.scalar_type(), cos.scalar_type(), form);
  const Mix mix = mix_of(q.scalar_type(), cos.scalar_type(), out_dtype);
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  const std::optional<Geometry> gq = geometry(q, c, s, form), gk = geometry(k, c, s, form);
  if (mix == Mix::kNone || !kernels_take(gq) || !kernels_take(gk)) {
    return rotary_fwd_composite(q, k, cos, sin, unsqueeze_dim, form);
  }
  at::Tensor q_out = rotary_out_like(q, q.sizes(), out_dtype, form);
  at::Tensor k_out = rotary_out_like(k, k.sizes(), out_dtype, form);
  dispatch_mix(q.scalar_type(), mix, [&](auto t, auto u, auto o) {
    using T = typename decltype(t)::type;
    using U = typename decltype(u)::type;
    using O = typename decltype(o)::type;
    Params p{};
    p.side[0] = make_side<T>(*gq, q, q_out, c, s, form);
    p.side[1] = make_side<T>(*gk, k, k_out, c, s, form);
    p.form = kernel_form(q.scalar_type(), cos.scalar_type(), form);
    launch<T, U, O, false>(p);
  });
  return {q_out, k_out};
}

RotaryPair rotary_bwd_cuda(const std::optional<at::Tensor>& grad_q,
                           const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                           at::ScalarType q_dtype) {
  check_rotary_bwd_args(grad_q, grad_k, cos, sin, unsqueeze_dim, form, q_dtype);
  const c10::cuda::CUDAGuard guard(cos.device());
  check_kernel_image(cos.get_device(), kOp);
  const bool want_q = present(grad_q), want_k = present(grad_k);
  // The grads arrive in the forward output's dtype (autograd casts them to it).
  const at::ScalarType g_dtype = rotary_out_dtype(q_dtype, cos.scalar_type(), form);
  const Mix mix = mix_of(q_dtype, cos.scalar_type(), g_dtype);
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  std::optional<Geometry> geo[2];
  bool takes = mix != Mix::kNone && (want_q || want_k);
  for (int i = 0; i < 2 && takes; ++i) {
    const std::optional<at::Tensor>& g = i == 0 ? grad_q : grad_k;
    if (!(i == 0 ? want_q : want_k)) continue;
    geo[i] = geometry(*g, c, s, form);
    takes = g->scalar_type() == g_dtype && kernels_take(geo[i]);
  }
  if (!takes) {
    return rotary_bwd_composite(grad_q, grad_k, cos, sin, unsqueeze_dim, form, q_dtype);
  }
  const at::TensorOptions opts = cos.options().dtype(q_dtype);
  // the grads' layout (q's, in the models' calls): the views' backward then copies nothing
  at::Tensor dq = want_q ? at::empty_like(*grad_q, opts) : at::empty({0}, opts);
  at::Tensor dk = want_k ? at::empty_like(*grad_k, opts) : at::empty({0}, opts);
  dispatch_mix(q_dtype, mix, [&](auto t, auto u, auto o) {
    using T = typename decltype(t)::type;
    using U = typename decltype(u)::type;
    using O = typename decltype(o)::type;
    Params p{};
    p.side[0] = want_q ? make_side<T>(*geo[0], *grad_q, dq, c, s, form) : empty_side();
    p.side[1] = want_k ? make_side<T>(*geo[1], *grad_k, dk, c, s, form) : empty_side();
    p.form = kernel_form(q_dtype, cos.scalar_type(), form);
    launch<T, U, O, true>(p);
  });
  return {dq, dk};
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("rotary_fwd", &rotary_fwd_cuda);
  m.impl("rotary_bwd", &rotary_bwd_cuda);
}

}  // namespace fastlayers
