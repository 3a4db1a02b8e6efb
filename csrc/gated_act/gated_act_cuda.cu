// Gated activation CUDA kernels: y = act(gate) * up and its backward, one pass each, with the
// rules of gated_act.h. gate and up are read as [rows, cols] with a row stride of their own, so
// the halves of h.chunk(2, -1) are read in place (no copy); outputs are contiguous.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "common/arch_check.h"
#include "common/common.h"
#include "common/cuda_utils.cuh"
#include "gated_act/gated_act.h"

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.gated_act";
constexpr int kThreads = 256;
constexpr int kBlocksPerSM = 8;  // 2048 threads: a full SM; the grid-stride loop does the rest

// An operand as the kernels read it: row r starts at ptr + r * stride, its cols contiguous.
template <typename T>
struct Rows {
  const T* ptr;
  int64_t stride;
};

// The row stride of t viewed as [rows, cols] (cols its last dimension): its last dimension must
// be contiguous and its leading dimensions collapse to one stride; -1 when they do not.
int64_t collapsed_row_stride(const at::Tensor& t) {
  const int64_t dim = t.dim();
  if (dim == 0) return 1;
  const int64_t cols = t.size(dim - 1);
  if (cols > 1 && t.stride(dim - 1) != 1) return -1;
  int64_t stride = -1, span = 0;  // the row stride; the stride the next outer dimension needs
  for (int64_t d = dim - 2; d >= 0; --d) {
    const int64_t n = t.size(d);
    if (n == 1) continue;
    if (stride < 0) {
      stride = t.stride(d);
      span = stride * n;
    } else if (t.stride(d) != span) {
      return -1;
    } else {
      span *= n;
    }
  }
  return stride < 0 ? cols : stride;
}

// t as rows (kept alive in `hold`): in place when its layout allows, else a contiguous copy.
template <typename T>
Rows<T> rows_of(const at::Tensor& t, at::Tensor& hold) {
  const int64_t stride = collapsed_row_stride(t);
  if (stride >= 0) {
    hold = t;
    return {t.data_ptr<T>(), stride};
  }
  hold = t.contiguous();
  return {hold.data_ptr<T>(), t.dim() == 0 ? 1 : t.size(-1)};
}

// 16-byte vectors where the data allows (W = vec_of<T>()), single elements otherwise (W = 1).
template <typename T, int W, typename A>
__device__ __forceinline__ void load_w(const T* p, A (&out)[W]) {
  if constexpr (W == 1) {
    out[0] = static_cast<A>(*p);
  } else {
    cuda::load_floats<T, W>(p, out);
  }
}

template <typename T, int W, typename A>
__device__ __forceinline__ void store_w(T* p, const A (&in)[W]) {
  if constexpr (W == 1) {
    *p = static_cast<T>(in[0]);
  } else {
    cuda::store_floats<T, W>(p, in);
  }
}

// Grid-stride over the units (W elements of one row each): `per_row` units a row, `total` in
// all. I is the division's type: uint32_t where total fits (a cheaper divide), else int64_t.
// Outputs are contiguous: row r at r * per_row * W.
template <typename T, Activation kAct, int W, typename I>
__global__ void __launch_bounds__(kThreads)
    gated_act_fwd_kernel(Rows<T> gate, Rows<T> up, T* __restrict__ out, int64_t per_row,
                         int64_t total) {
  using A = at::opmath_type<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += step) {
    const int64_t row = static_cast<int64_t>(static_cast<I>(i) / static_cast<I>(per_row));
    const int64_t col = (i - row * per_row) * W;
    if constexpr (W > 1 && sizeof(T) == 2) {
      // round_T(round_T(act(g)) * u) is T's packed product of act(g) rounded to T and u's raw
      // words (cuda_utils.cuh: the same bits): up is never unpacked
      A g[W];
      load_w<T, W>(gate.ptr + row * gate.stride + col, g);
      const cuda::RawVec<T, W> u = cuda::load_raw<T, W>(up.ptr + row * up.stride + col);
      cuda::RawVec<T, W> y;
#pragma unroll
      for (int k = 0; k < W / 2; ++k) {
        const uint32_t a = cuda::pack2<T>(activation_value(g[2 * k], kAct),
                                          activation_value(g[2 * k + 1], kAct));
        cuda::words_of(y)[k] = cuda::mul2<T>(a, cuda::words_of(u)[k]);
      }
      cuda::store_raw<T, W>(out + row * per_row * W + col, y);
    } else {
      A g[W], u[W], y[W];
      load_w<T, W>(gate.ptr + row * gate.stride + col, g);
      load_w<T, W>(up.ptr + row * up.stride + col, u);
#pragma unroll
      for (int k = 0; k < W; ++k) y[k] = gated_act_value<T, kAct>(g[k], u[k]);
      store_w<T, W>(out + row * per_row * W + col, y);
    }
  }
}

// dgate, dup or product may be null (not asked for); the branches on them are uniform. product
// is act(gate) * up again, rounded as the forward rounds it (round_T(round_T(act(g)) * u): the
// product of two T values is exact in float, so its one rounding here is the forward's packed
// multiply's), for a backward that did not keep the forward's.
template <typename T, Activation kAct, int W, typename I>
__global__ void __launch_bounds__(kThreads)
    gated_act_bwd_kernel(Rows<T> dy, Rows<T> gate, Rows<T> up, T* __restrict__ dgate,
                         T* __restrict__ dup, T* __restrict__ product, int64_t per_row,
                         int64_t total) {
  using A = at::opmath_type<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += step) {
    const int64_t row = static_cast<int64_t>(static_cast<I>(i) / static_cast<I>(per_row));
    const int64_t col = (i - row * per_row) * W;
    A d[W], g[W], u[W], dg[W], du[W];
    load_w<T, W>(dy.ptr + row * dy.stride + col, d);
    load_w<T, W>(gate.ptr + row * gate.stride + col, g);
    load_w<T, W>(up.ptr + row * up.stride + col, u);
#pragma unroll
    for (int k = 0; k < W; ++k) gated_act_grad<T, kAct>(d[k], g[k], u[k], dg[k], du[k]);
    const int64_t o = row * per_row * W + col;
    if (dgate != nullptr) store_w<T, W>(dgate + o, dg);
    if (dup != nullptr) store_w<T, W>(dup + o, du);
    if (product != nullptr) {
      A y[W];
#pragma unroll
      for (int k = 0; k < W; ++k) y[k] = gated_act_value<T, kAct>(g[k], u[k]);
      store_w<T, W>(product + o, y);
    }
  }
}

// f(std::integral_constant<Activation, act>{}): the activation as a template argument, so each
// kernel holds one activation's code.
template <typename F>
void dispatch_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kSiLU:
      f(std::integral_constant<Activation, Activation::kSiLU>{});
      break;
    case Activation::kGeluErf:
      f(std::integral_constant<Activation, Activation::kGeluErf>{});
      break;
    case Activation::kGeluTanh:
      f(std::integral_constant<Activation, Activation::kGeluTanh>{});
      break;
    default:
      f(std::integral_constant<Activation, Activation::kReLU>{});
  }
}

// The launch shape of rows x cols elements: vectors when every row of every operand starts on a
// 16-byte boundary (pointers aligned, cols and row strides whole vectors), else single elements.
struct Plan {
  bool vectorized;
  bool narrow_index;  // the unit count fits the uint32_t divide
  int64_t per_row, total, blocks;
};

template <typename T>
Plan plan(int64_t rows, int64_t cols, std::initializer_list<const void*> ptrs,
             std::initializer_list<int64_t> strides) {
  constexpr int kVec = cuda::vec_of<T>();
  bool vec = cols % kVec == 0;
  for (const void* p : ptrs) vec = vec && cuda::aligned16(p);
  for (int64_t s : strides) vec = vec && s % kVec == 0;
  const int64_t per_row = vec ? cols / kVec : cols;
  const int64_t total = rows * per_row;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, sms * kBlocksPerSM);
  return {vec, total <= std::numeric_limits<uint32_t>::max(), per_row, total, blocks};
}

// Calls f(width, index) for the plan: the vector width as an integral_constant, a value of the
// divide's index type.
template <typename T, typename F>
void dispatch_plan(const Plan& p, F&& f) {
  constexpr int kVec = cuda::vec_of<T>();
  if (p.vectorized) {
    if (p.narrow_index) {
      f(std::integral_constant<int, kVec>{}, uint32_t{});
    } else {
      f(std::integral_constant<int, kVec>{}, int64_t{});
    }
  } else {
    f(std::integral_constant<int, 1>{}, int64_t{});
  }
}

int64_t cols_of(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.size(-1); }

}  // namespace

at::Tensor gated_act_fwd_cuda(const at::Tensor& gate, const at::Tensor& up,
                              c10::string_view activation) {
  const Activation act = parse_gated_activation(activation);
  check_gated_act_args(gate, up);
  const c10::cuda::CUDAGuard guard(gate.device());
  check_kernel_image(gate.get_device(), kOp);
  at::Tensor y = at::empty(gate.sizes(), gate.options());
  if (y.numel() == 0) return y;
  const int64_t cols = cols_of(gate), rows = y.numel() / cols;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype_f64(gate.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    at::Tensor hold_g, hold_u;
    const Rows<T> g = rows_of<T>(gate, hold_g), u = rows_of<T>(up, hold_u);
    T* out = y.data_ptr<T>();
    const Plan p = plan<T>(rows, cols, {g.ptr, u.ptr, out}, {g.stride, u.stride});
    dispatch_activation(act, [&](auto a) {
      dispatch_plan<T>(p, [&](auto w, auto index) {
        gated_act_fwd_kernel<T, decltype(a)::value, decltype(w)::value, decltype(index)>
            <<<p.blocks, kThreads, 0, stream>>>(g, u, out, p.per_row, p.total);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return y;
}

GatedActGrads gated_act_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& gate,
                                 const at::Tensor& up, c10::string_view activation,
                                 std::array<bool, 3> output_mask) {
  const Activation act = parse_gated_activation(activation);
  check_gated_act_args(gate, up, grad_out);
  const c10::cuda::CUDAGuard guard(gate.device());
  check_kernel_image(gate.get_device(), kOp);
  const auto grad_or_empty = [&](bool want) {
    return want ? at::empty(gate.sizes(), gate.options()) : at::empty({0}, gate.options());
  };
  at::Tensor dgate = grad_or_empty(output_mask[0]), dup = grad_or_empty(output_mask[1]);
  at::Tensor product = grad_or_empty(output_mask[2]);
  if (gate.numel() == 0 || !(output_mask[0] || output_mask[1] || output_mask[2])) {
    return {dgate, dup, product};
  }
  const int64_t cols = cols_of(gate), rows = gate.numel() / cols;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype_f64(gate.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    at::Tensor hold_d, hold_g, hold_u;
    const Rows<T> d = rows_of<T>(grad_out, hold_d), g = rows_of<T>(gate, hold_g),
                  u = rows_of<T>(up, hold_u);
    T* dg = output_mask[0] ? dgate.data_ptr<T>() : nullptr;
    T* du = output_mask[1] ? dup.data_ptr<T>() : nullptr;
    T* y = output_mask[2] ? product.data_ptr<T>() : nullptr;
    const Plan p =
        plan<T>(rows, cols, {d.ptr, g.ptr, u.ptr, dg, du, y}, {d.stride, g.stride, u.stride});
    dispatch_activation(act, [&](auto a) {
      dispatch_plan<T>(p, [&](auto w, auto index) {
        gated_act_bwd_kernel<T, decltype(a)::value, decltype(w)::value, decltype(index)>
            <<<p.blocks, kThreads, 0, stream>>>(d, g, u, dg, du, y, p.per_row, p.total);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {dgate, dup, product};
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) {
  m.impl("gated_act_fwd", &gated_act_fwd_cuda);
  m.impl("gated_act_bwd", &gated_act_bwd_cuda);
}

}  // namespace fastlayers
