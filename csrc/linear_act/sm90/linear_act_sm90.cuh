// The sm_90a GEMMs of the Linear + activation family: CUTLASS 3 TMA warp-specialised kernels
// (wgmma mainloop) with one of two epilogues. Included only by the per-dtype instantiation files.
//
// Pass::kForward: z = acc + bias, optionally stored (the pre-activation GELU's backward needs),
//   and act(z) written. Visitor tree: Act(AuxStore(plus(acc, RowBroadcast bias))).
// Pass::kForwardKeepDerivative (an MLP's forward): the same, act'(z) stored instead of z (what the
//   MLP's backward GEMM then multiplies by). Visitor tree: convert(ActAuxStore(plus(...))).
// Pass::kDgrad (the backward GEMM that produces the activation's incoming gradient, e.g. an
//   MLP's dy . W2): dz = act'(saved) * acc written, saved (z, or y for ReLU) read by TMA. With
//   Problem::gated, a gated MLP's up projection instead: act(gate) * acc, gate read as saved.
//   Visitor tree: ColumnPartials(DAct(acc, AuxLoad saved)): when asked, each output tile also
//   writes the column sums of its dz (float, before rounding), one row per epilogue warp, into
//   a [row tiles x warps, n] buffer, which the caller sums (the bias gradient). CUTLASS's
//   Sm90RowReduction made this kernel keep 464-528 bytes of stack per thread and run 4x slower
//   than the bare GEMM (H100, measured); Sm90ColumnPartials keeps none.
// Bias and aux are optional at run time (null pointers), and the activation
// (GELU erf/tanh, ReLU) is a run-time argument, so one kernel per (pass, dtype, weight layout,
// tile config) serves every call.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "linear_act/gelu_epilogue.cuh"
#include "linear_act/sm90/linear_act_sm90.h"

namespace fastlayers {
namespace sm90 {

struct EpilogueArgs {
  int kind = static_cast<int>(Activation::kGeluErf);
  // Pass::kDgrad only: the gated MLP's product instead of a derivative (Problem::gated)
  bool gated = false;
};

// GELU by the epilogue's MUFU forms (gelu_epilogue.cuh); ReLU by the shared relu_value.
CUTLASS_DEVICE float apply_epilogue(float z, int kind) {
  if (kind == static_cast<int>(Activation::kGeluErf)) return gelu_epilogue::gelu_erf(z);
  if (kind == static_cast<int>(Activation::kGeluTanh)) return gelu_epilogue::gelu_tanh(z);
  if (kind == static_cast<int>(Activation::kReLU)) return relu_value(z);
  return z;
}

// The activation's derivative times the incoming gradient, as the backward epilogue computes it:
// GELU by the MUFU forms of gelu_epilogue.cuh, ReLU by the shared activation_grad.
CUTLASS_DEVICE float apply_epilogue_grad(float dy, float saved, int kind) {
  if (kind == static_cast<int>(Activation::kGeluErf))
    return dy * gelu_epilogue::gelu_erf_grad(saved);
  if (kind == static_cast<int>(Activation::kGeluTanh))
    return dy * gelu_epilogue::gelu_tanh_grad(saved);
  return activation_grad(dy, saved, static_cast<Activation>(kind));
}

// The activation node of the visitor tree; CUTLASS calls it on fragments (Array) with the
// run-time arguments (the form is uniform across the launch, so the branch is too).
template <class T>
struct EpilogueFn {
  using Arguments = EpilogueArgs;
  CUTLASS_DEVICE T operator()(T const& z, Arguments const& args) const {
    return apply_epilogue(z, args.kind);
  }
};

template <class T, int N>
struct EpilogueFn<cutlass::Array<T, N>> {
  using Arguments = EpilogueArgs;
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& z,
                                                 Arguments const& args) const {
    cutlass::Array<T, N> out;
    if (args.kind == static_cast<int>(Activation::kGeluErf)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = gelu_epilogue::gelu_erf(z[i]);
    } else if (args.kind == static_cast<int>(Activation::kGeluTanh)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = gelu_epilogue::gelu_tanh(z[i]);
    } else if (args.kind == static_cast<int>(Activation::kReLU)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = relu_value(z[i]);
    } else {
      out = z;
    }
    return out;
  }
};

// Pass::kForwardKeepDerivative's act(z) and act'(z) on a fragment (GELU: sharing their exp2).
// The op asks it for GELU only; other forms keep z.
template <int N>
CUTLASS_DEVICE void act_and_derivative(cutlass::Array<float, N> const& z,
                                       EpilogueArgs const& args, cutlass::Array<float, N>& y,
                                       cutlass::Array<float, N>& kept) {
  if (args.kind == static_cast<int>(Activation::kGeluErf)) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) gelu_epilogue::gelu_erf_and_grad(z[i], y[i], kept[i]);
  } else if (args.kind == static_cast<int>(Activation::kGeluTanh)) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) gelu_epilogue::gelu_tanh_and_grad(z[i], y[i], kept[i]);
  } else {
    y = EpilogueFn<cutlass::Array<float, N>>{}(z, args);
    kept = z;
  }
}

// The gated MLP's product as native rounds it (gated_act_value's rule): act(gate) rounded to
// Element, times up = acc rounded to Element; the caller's store rounds the product. The
// activation by activation.h's accurate forms (gate is exact, so act(gate) is native's value up to
// those forms' own last-ulp differences from ATen's, as in gated_act's kernel; SiLU by the
// hardware approximations, a few float ulps off, below), one activation per loop:
// four activations inlined per element made the epilogue 4-6x slower than the GEMM (H200).
template <class Element, Activation kAct, int N>
CUTLASS_DEVICE void gated_product(cutlass::Array<float, N> const& acc,
                                  cutlass::Array<float, N> const& gate,
                                  cutlass::Array<float, N>& out) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < N; ++i) {
    float a;
    if constexpr (kAct == Activation::kSiLU) {
      // z / (1 + exp(-z)) by the hardware exp2 and the approximate division: the accurate expf
      // and IEEE division made this epilogue 1.3x slower than tanh GELU's (H200, 8192 x 2048 ->
      // 5632: 379 against 296 us) and slower than cuBLAS plus gated_act. A few float ulps off
      // (__expf's error grows with |z|), far inside bfloat16's or half's rounding step: act(gate)
      // rounded to Element is native's value but where the quotient lies that close to a
      // rounding boundary, and for z in about [-88.7, -87.3], where __fdividef's divisor passes
      // 2^126 and it gives -0 for native's ~-1e-37. -inf and NaN give NaN, +inf gives +inf.
      const float z = gate[i];
      a = __fdividef(z, 1.0f + __expf(-z));
    } else {
      a = activation_value(gate[i], kAct);
    }
    out[i] = static_cast<float>(static_cast<Element>(a)) *
             static_cast<float>(static_cast<Element>(acc[i]));
  }
}

// SiLU (LLaMA, Mistral, Qwen) and tanh GELU (Gemma) only: each activation's unrolled loop adds
// about 2,500 instructions to every backward-GEMM kernel. Any other kind computes tanh GELU: the
// host never sets Problem::gated for one (gated_linear_ineligible sends them to cuBLAS and
// gated_act).
template <class Element, int N>
CUTLASS_DEVICE void gated_product(cutlass::Array<float, N> const& acc,
                                  cutlass::Array<float, N> const& gate, int kind,
                                  cutlass::Array<float, N>& out) {
  if (kind == static_cast<int>(Activation::kSiLU)) {
    gated_product<Element, Activation::kSiLU>(acc, gate, out);
  } else {
    gated_product<Element, Activation::kGeluTanh>(acc, gate, out);
  }
}

// The derivative node of the backward tree: (acc, saved) fragments -> dz; with args.gated the
// gated product act(saved) * acc instead (Problem::gated). Element: the GEMM's dtype.
template <class T, class Element>
struct DActFn {
  using Arguments = EpilogueArgs;
  CUTLASS_DEVICE T operator()(T const& acc, T const& saved, Arguments const& args) const {
    return apply_epilogue_grad(acc, saved, args.kind);
  }
};

template <class T, int N, class Element>
struct DActFn<cutlass::Array<T, N>, Element> {
  using Arguments = EpilogueArgs;
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& acc,
                                                 cutlass::Array<T, N> const& saved,
                                                 Arguments const& args) const {
    cutlass::Array<T, N> out;
    if (args.gated) {  // uniform across the launch
      gated_product<Element>(acc, saved, args.kind, out);
      return out;
    }
    // one branch per fragment, the loops inside it (as EpilogueFn)
    if (args.kind == static_cast<int>(Activation::kGeluErf)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = acc[i] * gelu_epilogue::gelu_erf_grad(saved[i]);
    } else if (args.kind == static_cast<int>(Activation::kGeluTanh)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = acc[i] * gelu_epilogue::gelu_tanh_grad(saved[i]);
    } else if (args.kind == static_cast<int>(Activation::kSavedDerivative)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = acc[i] * saved[i];
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = apply_epilogue_grad(acc[i], saved[i], args.kind);
    }
    return out;
  }
};

// DActFn for one GEMM dtype, as the visitor tree's compute node takes it (a one-parameter
// template).
template <class Element>
struct DActFnOf {
  template <class T>
  using Fn = DActFn<T, Element>;
};

// Fusion tag of the backward pass: D = act'(Aux) * acc, Aux read (row-major, like D). Declaring
// the aux input lets CUTLASS's epilogue builder pick the aux shared-memory layout and copy atom.
template <class Element>
struct DAct : cutlass::epilogue::fusion::FusionOperation {
  using ElementOutput = Element;
  using ElementCompute = float;
  using ElementAux = Element;
  using GmemLayoutTagAux = cutlass::layout::RowMajor;
  static constexpr int AlignmentAux = 128 / cutlass::sizeof_bits_v<Element>;
  static constexpr bool IsAuxInSupported = true;
};

// Fusion tag: D = act(acc + bias[col]); Aux = acc + bias[col] (row-major, like D), or act'(acc +
// bias[col]) where kKeepDerivative (Pass::kForwardKeepDerivative). Declaring the aux output lets
// CUTLASS's epilogue builder pick the aux shared-memory layout and copy atom.
template <class Element, bool kKeepDerivative = false>
struct BiasActAux : cutlass::epilogue::fusion::FusionOperation {
  using ElementOutput = Element;
  using ElementCompute = float;
  using ElementBias = Element;
  static constexpr int AlignmentBias = 128 / cutlass::sizeof_bits_v<Element>;
  static constexpr bool IsPerColBiasSupported = true;
  using ActivationFn = EpilogueFn<float>;
  static constexpr bool IsEltActSupported = true;
  using ElementAux = Element;
  using GmemLayoutTagAux = cutlass::layout::RowMajor;
  static constexpr int AlignmentAux = 128 / cutlass::sizeof_bits_v<Element>;
  static constexpr bool IsAuxOutSupported = true;
};

}  // namespace sm90
}  // namespace fastlayers

namespace cutlass::epilogue::fusion {

// One step of a reduce-scatter over the lanes that hold the same columns: the lane keeps one
// half of its 2 * kHalf values (the upper half where lane & bit is set), adds its partner's
// (lane ^ bit) values of that half and hands over the other half; the kept values, and their
// columns, move to the front.
template <int kHalf>
CUTLASS_DEVICE void keep_half(float* v, int* col, int lane, int bit) {
  const bool upper = (lane & bit) != 0;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kHalf; ++i) {
    const float give = upper ? v[i] : v[i + kHalf];
    const float keep = upper ? v[i + kHalf] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffff, give, bit);
    col[i] = upper ? col[i + kHalf] : col[i];
  }
}

// Column sums of the value it visits (the backward GEMM's dz, before rounding), one row of
// partial sums per warp of each output tile: partials[tile_m * warps + warp][col] for the tile's
// columns, in float (every warp of the sm90 accumulator layout holds all the tile's columns for
// its own rows). Each thread adds its own elements of a column (registers, stride 0 along the
// rows); the eight lanes that hold the same columns then reduce-scatter them by xor shuffles, so
// each lane ends with the warp's sums of a few columns and stores them: no shared memory, no
// barrier, no atomics, a fixed order, so the sums are the same bits on every run. The caller sums
// the rows over the row tiles and warps (in a fixed order too). Passes its input through
// unchanged. (A first form added the warps' sums through shared memory, three barriers per tile:
// 2-2.5 us more per backward GEMM with db at BERT-base and GPT-2 medium shapes, H100.)
template <class CtaTileShapeMNK>
struct Sm90ColumnPartials {
  struct SharedStorage {};
  struct Arguments {
    float* partials = nullptr;  // [row tiles x warps, ld]; null: nothing summed
    int64_t ld = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE Sm90ColumnPartials() {}
  CUTLASS_HOST_DEVICE Sm90ColumnPartials(Params const& params, SharedStorage const&)
      : params(params) {}
  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(ProducerLoadArgs<Args...> const&) {
    return EmptyProducerLoadCallbacks{};
  }

  template <int kThreads, class RTensor, class CTensor>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RTensor&& sums, CTensor coords, int64_t tile_m,
                                          int64_t tile_n, int64_t rows, int thread_idx,
                                          Params const& params)
        : sums(cute::forward<RTensor>(sums)), coords(coords), tile_m(tile_m), tile_n(tile_n),
          rows(rows), thread_idx(thread_idx), params(params) {}

    RTensor sums;    // (CPY,CPY_M,CPY_N,EPI_M,EPI_N), stride 0 along M: one per column
    CTensor coords;  // the same elements' (m, n) in the tile
    int64_t tile_m, tile_n, rows;
    int thread_idx;
    Params const& params;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE Array<ElementInput, FragmentSize> visit(
        Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
        Array<ElementInput, FragmentSize> const& value) {
      if (params.partials != nullptr) {
        Tensor sums_mn = sums(_, _, _, epi_m, epi_n);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i)
          sums_mn(epi_v * FragmentSize + i) += float(value[i]);
      }
      return value;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      constexpr int kTileM = size<0>(CtaTileShapeMNK{});
      // (a 2x1 cluster's tile past the last row has no rows in partials; a 1x2 cluster's tile
      // past the last column stores nothing, below)
      if (!is_last_iteration || params.partials == nullptr || tile_m * kTileM >= rows) return;
      constexpr int kTileN = size<1>(CtaTileShapeMNK{});
      constexpr int kWarps = kThreads / 32;
      // each distinct register's column in the tile (its duplicates along the rows share it)
      Tensor cols = make_tensor_like<int>(sums);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(sums); ++i) cols(i) = get<1>(coords(i));
      Tensor distinct_sums = filter(sums);
      Tensor distinct_cols = filter(cols);
      constexpr int kDistinct = decltype(size(distinct_sums))::value;
      // the sm90 accumulator layout: lanes with equal lane % 4 hold the same kTileN / 4 columns
      static_assert(kDistinct * 4 == kTileN && kDistinct % 8 == 0);
      float v[kDistinct];
      int col[kDistinct];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kDistinct; ++i) {
        v[i] = distinct_sums(i);
        col[i] = distinct_cols(i);
      }
      // three halving steps over lane bits 2..4 (each with its own constant count, so every
      // index stays static and the arrays in registers)
      const int lane = thread_idx % 32;
      keep_half<kDistinct / 2>(v, col, lane, 4);
      keep_half<kDistinct / 4>(v, col, lane, 8);
      keep_half<kDistinct / 8>(v, col, lane, 16);
      const int warp = thread_idx / 32;
      const int64_t col0 = tile_n * kTileN;
      float* row = params.partials + (tile_m * kWarps + warp) * params.ld + col0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kDistinct / 8; ++i)
        if (col0 + col[i] < params.ld) row[col[i]] = v[i];
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    // a [M, N] view with stride 0 along M gives each thread one register per column
    Tensor mCol = make_tensor(make_gmem_ptr<float>(params.partials), make_shape(M, N),
                              make_stride(_0{}, _1{}));
    Tensor gCol = local_tile(mCol, take<0, 2>(args.tile_shape_mnk), make_coord(m, n));
    Tensor tCgCol = sm90_partition_for_epilogue<ReferenceSrc>(gCol, args.epi_tile,
                                                              args.tiled_copy, args.thread_idx);
    Tensor sums = make_tensor_like<float>(tCgCol);
    fill(sums, 0.f);
    // the same elements' (m, n) in the tile (args.tCcD counts from the thread's first element)
    Tensor coords = sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(take<0, 2>(args.tile_shape_mnk)), args.epi_tile, args.tiled_copy,
        args.thread_idx);
    constexpr int kThreads = decltype(args.tiled_copy)::TiledNumThr::value;
    return ConsumerStoreCallbacks<kThreads, decltype(sums), decltype(coords)>(
        cute::move(sums), coords, int64_t(m), int64_t(n), int64_t(M), args.thread_idx, params);
  }
};

}  // namespace cutlass::epilogue::fusion

namespace cutlass::epilogue::fusion {

// Pass::kForwardKeepDerivative's activation node and aux store in one: CUTLASS's aux store
// (AuxStore, whose shared memory, TMA store and null-pointer skip it keeps) visiting z stores
// act'(z) and passes act(z) on (act_and_derivative). One node, so the value and the derivative
// share their exp2 (in two nodes each would read its own copy of the run-time form and compute it
// again). Its own kernels: with this node in the plain forward's tree too (the derivative a
// run-time choice), the plain forward ran 1-2 us slower at 8192 x 768 -> 3072 (H100, bf16: ReLU
// 61.4 against 59.6, erf 70.3 against 69.1; docs/decisions.md).
template <class AuxStore>
struct Sm90ActAuxStore : AuxStore {
  struct Arguments {
    typename AuxStore::Arguments aux{};
    fastlayers::sm90::EpilogueArgs act{};
  };
  struct Params {
    typename AuxStore::Params aux;
    fastlayers::sm90::EpilogueArgs act;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args,
                                                  void* workspace) {
    return {AuxStore::to_underlying_arguments(shape, args.aux, workspace), args.act};
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return AuxStore::can_implement(shape, args.aux);
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& shape, Arguments const& args) {
    return AuxStore::get_workspace_size(shape, args.aux);
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const& shape, Arguments const& args,
                                              void* workspace, cudaStream_t stream,
                                              CudaHostAdapter* adapter = nullptr) {
    return AuxStore::initialize_workspace(shape, args.aux, workspace, stream, adapter);
  }

  CUTLASS_HOST_DEVICE Sm90ActAuxStore() {}
  CUTLASS_HOST_DEVICE Sm90ActAuxStore(Params const& params,
                                      typename AuxStore::SharedStorage const& shared)
      : AuxStore(params.aux, shared), act(params.act) {}
  fastlayers::sm90::EpilogueArgs act;

  template <class Inner>
  struct ConsumerStoreCallbacks : Inner {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Inner&& inner, fastlayers::sm90::EpilogueArgs act)
        : Inner(cute::move(inner)), act(act) {}
    fastlayers::sm90::EpilogueArgs act;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE Array<float, FragmentSize> visit(
        Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m, int epi_n,
        Array<ElementInput, FragmentSize> const& z) {
      Array<float, FragmentSize> y, kept;
      fastlayers::sm90::act_and_derivative(z, act, y, kept);
      Inner::visit(frg_acc, epi_v, epi_m, epi_n, kept);
      return y;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    auto inner = AuxStore::template get_consumer_store_callbacks<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(inner)>(cute::move(inner), act);
  }
};

// The forward trees' shared parts: z = acc + RowBroadcast(bias), and the row-major aux store.
template <class Element, class CtaTileShapeMNK>
using BiasAdd = Sm90EVT<Sm90Compute<cutlass::plus, float, float, FloatRoundStyle::round_to_nearest>,
                        Sm90AccFetch,
                        Sm90RowBroadcast<0, CtaTileShapeMNK, Element, float,
                                         cute::Stride<cute::_0, cute::_1, int64_t>>>;
template <int StagesD, class Element, class EpilogueTile, class SmemLayoutAtom, class CopyOpR2S>
using RowMajorAuxStore =
    Sm90AuxStore<StagesD, EpilogueTile, Element, FloatRoundStyle::round_to_nearest,
                 cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>, SmemLayoutAtom,
                 CopyOpR2S>;

// The visitor tree of BiasActAux: act(AuxStore(acc + RowBroadcast(bias))); with kKeepDerivative,
// ActAuxStore(acc + RowBroadcast(bias)) (act(z) on, act'(z) stored), converted to the output
// dtype.
template <bool kKeepDerivative, int StagesD, class Element, class CtaTileShapeMNK,
          class EpilogueTile, class SmemLayoutAtom, class CopyOpR2S>
using BiasActTree = std::conditional_t<
    kKeepDerivative,
    Sm90EVT<Sm90Compute<cutlass::epilogue::thread::Identity, Element, float,
                        FloatRoundStyle::round_to_nearest>,
            Sm90EVT<Sm90ActAuxStore<RowMajorAuxStore<StagesD, Element, EpilogueTile,
                                                     SmemLayoutAtom, CopyOpR2S>>,
                    BiasAdd<Element, CtaTileShapeMNK>>>,
    Sm90EVT<Sm90Compute<fastlayers::sm90::EpilogueFn, Element, float,
                        FloatRoundStyle::round_to_nearest>,
            Sm90EVT<RowMajorAuxStore<StagesD, Element, EpilogueTile, SmemLayoutAtom, CopyOpR2S>,
                    BiasAdd<Element, CtaTileShapeMNK>>>>;

// The visitor tree of DAct: dact(acc, AuxLoad(saved)), converted to the output dtype.
template <int StagesC, class Element, class CtaTileShapeMNK, class EpilogueTile,
          class SmemLayoutAtom, class CopyOpS2R>
using DActTree = Sm90EVT<
    Sm90ColumnPartials<CtaTileShapeMNK>,
    Sm90EVT<Sm90Compute<fastlayers::sm90::DActFnOf<Element>::template Fn, float, float,
                        FloatRoundStyle::round_to_nearest>,
            Sm90AccFetch,
            Sm90AuxLoad<StagesC, EpilogueTile, Element,
                        cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>, SmemLayoutAtom,
                        CopyOpS2R>>>;

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore,
          class Element, class CtaTileShapeMNK, class EpilogueTile, class SmemLayoutAtom,
          class CopyOpS2R>
struct FusionCallbacks<
    epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
    fastlayers::sm90::DAct<Element>, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom, CopyOpS2R>
    : DActTree<StagesC, Element, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom, CopyOpS2R> {
  using Impl = DActTree<StagesC, Element, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom, CopyOpS2R>;
  using Operation = fastlayers::sm90::DAct<Element>;

  struct Arguments {
    Element const* saved_ptr = nullptr;
    int64_t saved_row_stride = 0;
    float* col_partials = nullptr;
    int64_t col_partials_ld = 0;
    fastlayers::sm90::EpilogueArgs act{};

    operator typename Impl::Arguments() const {
      using StrideAux = cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>;
      return {{{},  // acc
               {saved_ptr, Element(0), StrideAux{saved_row_stride, cute::_1{}, 0}},
               act},  // dact(acc, saved)
              {col_partials, col_partials_ld}};  // its column sums per warp of each row tile
    }
  };

  using Impl::Impl;
};

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore,
          class Element, class CtaTileShapeMNK, class EpilogueTile, class SmemLayoutAtom,
          class CopyOpR2S, bool kKeepDerivative>
struct FusionCallbacks<
    epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
    fastlayers::sm90::BiasActAux<Element, kKeepDerivative>, CtaTileShapeMNK, EpilogueTile,
    SmemLayoutAtom, CopyOpR2S>
    : BiasActTree<kKeepDerivative, StagesD, Element, CtaTileShapeMNK, EpilogueTile,
                  SmemLayoutAtom, CopyOpR2S> {
  using Impl = BiasActTree<kKeepDerivative, StagesD, Element, CtaTileShapeMNK, EpilogueTile,
                           SmemLayoutAtom, CopyOpR2S>;
  using Operation = fastlayers::sm90::BiasActAux<Element, kKeepDerivative>;

  struct Arguments {
    Element const* bias_ptr = nullptr;
    Element* aux_ptr = nullptr;
    int64_t aux_row_stride = 0;
    fastlayers::sm90::EpilogueArgs act{};

    operator typename Impl::Arguments() const {
      using StrideAux = cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>;
      const StrideAux stride_aux{aux_row_stride, cute::_1{}, 0};
      if constexpr (kKeepDerivative) {
        return {                             // convert(act_store(acc + bias))
                {                            // act_store(acc + bias): act'(z) kept
                 {{}, {bias_ptr, Element(0), {}}, {}},  // acc + bias[col] (0 when null)
                 {{aux_ptr, stride_aux}, act}},
                {}};
      } else {
        return {                             // act(store(acc + bias))
                {                            // store(acc + bias)
                 {{}, {bias_ptr, Element(0), {}}, {}},  // acc + bias[col] (0 when null)
                 {aux_ptr, stride_aux}},
                act};
      }
    }
  };

  using Impl::Impl;
};

}  // namespace cutlass::epilogue::fusion

namespace fastlayers {
namespace sm90 {

// kDgradAuxStages: shared-memory stages of the backward pass's saved-tensor (aux) loads; 0 keeps
// the epilogue builder's choice (four 64x64 subtiles at 128x128, one tile ahead).
template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_,
          class EpilogueTile_ = cutlass::epilogue::collective::EpilogueTileAuto,
          int kDgradAuxStages_ = 0>
struct TileConfig {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = KernelSchedule_;
  using EpilogueSchedule = EpilogueSchedule_;
  using EpilogueTile = EpilogueTile_;
  static constexpr int kDgradAuxStages = kDgradAuxStages_;
};

using cute::_1;
using cute::_128;
using cute::_2;
using cute::_256;
using cute::_64;

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingpongEpilogue = cutlass::epilogue::TmaWarpSpecialized;
using Cluster2x1 = cute::Shape<_2, _1, _1>;

// The cooperative tile in clusters of two along the columns: the pair shares its 256-row
// activation loads (the larger operand tile; the builder's 2x1 shares the 128-row weight tile).
// Measured against 2x1 (H100, bf16, one machine, alternating builds): 8192x4096->1024 identity
// 100.4-100.7 -> 95.0-95.4 us, erf 103.8-104.2 -> 98.5-98.9; 8192x2048->8192 and
// 8192x4096->16384 level within the runs' spread; cuBLAS's own kernels there are 1x2 too.
// Its backward pass loads the saved tensor two epilogue subtiles ahead (as Pingpong128x128's
// below): a fourth mainloop stage instead of three. Measured (H100, bf16, both in one build,
// forced, three alternations, us, a noisy run): dy . W2 8192x4096->16384 erf + db 1899-2058 ->
// 1774-1814, 8192x4096->1024 116.4-127.1 -> 109.8-122.6, Conv1D layout 8192x3072->12288
// 1160-1168 -> 1041-1078; faster in every pair, dz and db bitwise equal.
using Coop256x128 =
    TileConfig<cute::Shape<_256, _128, _64>, cute::Shape<_1, _2, _1>, Coop, CoopEpilogue,
               cutlass::epilogue::collective::EpilogueTileAuto, 2>;
// Ping-pong with wider epilogue subtiles than the builder's choice (64x32): fewer store round
// trips per tile and more independent elements per thread, so the epilogue fits under the other
// warp group's mainloop (measured: 8192x768->3072 erf 84.4 -> 76.1 us; 64x128 gained nothing).
// The backward pass loads its saved tensor two 64x64 subtiles ahead instead of the builder's four:
// the 16 KB of shared memory freed give the mainloop a sixth stage. Measured (H100, bf16, both in
// one build, forced, three alternations, us): dy . W2 at BERT-base 8192x768->3072 identity
// 71.0-71.3 -> 66.6-67.0, ReLU 70.8-71.5 -> 66.7-66.8, erf level (83.4-84.5), erf + db level
// (91.8-92.7 -> 92.6-93.6); GPT-2 medium 8192x1024->4096 ReLU 117.6-117.9 -> 113.4-113.5, erf
// 122.4-124.6 -> 119.6-122.5, erf + db 132.7-133.7 -> 131.4-132.3; few rows erf + db 1024 x 768 ->
// 3072 25.1-25.2 -> 24.3-24.4, 640 rows (unclustered) 19.4 -> 18.5-18.8, 1024 x 2048 -> 8192
// (unclustered) 64.9-65.4 -> 61.4-61.7. Six aux stages (five mainloop stages) were 0.5-1 us slower
// than four, eight (four mainloop stages) 8-12 us slower.
using Pingpong128x128 = TileConfig<cute::Shape<_128, _128, _64>, Cluster2x1, Pingpong,
                                   PingpongEpilogue, cute::Shape<_64, _64>, 2>;
// The same without the cluster, for the forward's one wave of tiles with an odd number of 128-row
// tiles, which pairs along the rows would spread over two waves (big_tiles). Measured (bf16 erf,
// H100, 132 SMs): 544..640 x 768 -> 3072 (5 x 24 tiles) 14.7-14.8 us against 19.3-20.0 clustered
// and eager's 15.2-16.8. The cluster's shared weight loads are worth keeping elsewhere: 8192 x
// 768 -> 3072 ran 65 us without it, 58 us with it.
using Pingpong128x128Solo = TileConfig<cute::Shape<_128, _128, _64>, cute::Shape<_1, _1, _1>,
                                       Pingpong, PingpongEpilogue, cute::Shape<_64, _64>, 2>;
// Small problems (up to three of its tiles per SM): 64x64 tiles, each warp group its own tile.
// Four times the tiles of 128x128, so more SMs stream the weight, and no MMA on padding rows
// below 64. Measured (bf16 erf, H100), against a cooperative 128x64 tile tried first:
// 32x1024->4096 13.2-13.6 -> 11.1-11.7 us (eager 12.9), 512x768->3072 15.5 -> 13.2-13.7 (eager
// 15.3). Splitting K instead (CUTLASS's stream-K scheduler, deterministic split-K or stream-K)
// was slower at every few-rows shape measured (K 768 and 1024): the turnstile that adds the
// partial sums in order costs more than the shorter mainloops save.
using Pingpong64x64 = TileConfig<cute::Shape<_64, _64, _64>, cute::Shape<_1, _1, _1>, Pingpong,
                                 PingpongEpilogue>;

// The epilogue collective (no source C, D row-major) as CUTLASS's builder makes it, from the
// builder's own dispatch policy, except that the backward pass takes Config::kDgradAuxStages
// stages of aux loads where that is set.
template <class Config, class Element, int kAlign, class FusionOp, bool kDgrad>
struct EpilogueOf {
  using Layout = cutlass::layout::RowMajor;
  using EpilogueTileMN =
      decltype(cutlass::epilogue::collective::detail::sm90_compute_tile_shape_or_override<
               Element, typename Config::EpilogueTile, typename Config::EpilogueSchedule,
               typename Config::TileShape>());
  using BuilderPolicy =
      decltype(cutlass::epilogue::collective::detail::sm90_get_tma_dispatch_policy<
               typename Config::TileShape, EpilogueTileMN, void, Element,
               typename Config::EpilogueSchedule>());
  static constexpr int kStagesC = kDgrad && Config::kDgradAuxStages > 0 ? Config::kDgradAuxStages
                                                                        : BuilderPolicy::StagesC;
  using Policy = cutlass::epilogue::Sm90TmaWarpSpecialized<
      kStagesC, BuilderPolicy::StagesD, BuilderPolicy::FragmentSize, BuilderPolicy::ReuseSmemC,
      BuilderPolicy::DelayTmaStore>;
  using CollectiveOp = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      typename Config::TileShape, EpilogueTileMN, float, float, void, Layout, kAlign, Element,
      Layout, kAlign, FusionOp, Policy>::CollectiveOp;
};

// The GEMM D[m, n] = A[m, k] . B[k, n] with A = x (row-major, K-major) and B = W^T: W [n, k]
// row-major is a K-major B (ColumnMajor); W^T stored [k, n] row-major is an N-major B.
template <class Element, bool kWTransposed, class Config, Pass kPass>
struct LinearActGemm {
  using FusionOp = std::conditional_t<
      kPass == Pass::kDgrad, DAct<Element>,
      BiasActAux<Element, kPass == Pass::kForwardKeepDerivative>>;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits_v<Element>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB =
      std::conditional_t<kWTransposed, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  using LayoutD = cutlass::layout::RowMajor;

  using CollectiveEpilogue = typename EpilogueOf<Config, Element, kAlign, FusionOp,
                                                 kPass == Pass::kDgrad>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, float, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                           CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  static typename Gemm::Arguments arguments(const Problem& p) {
    using StrideA = typename GemmKernel::StrideA;
    using StrideB = typename GemmKernel::StrideB;
    using StrideD = typename GemmKernel::StrideD;
    const auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(p.m, p.k, 1));
    const auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(p.n, p.k, 1));
    const auto stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(p.m, p.n, 1));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = p.device;
    hw.sm_count = p.sm_count;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {p.m, p.n, p.k, 1},
        {static_cast<const Element*>(p.x), stride_a, static_cast<const Element*>(p.w), stride_b},
        {{}, nullptr, stride_d, static_cast<Element*>(p.y), stride_d},
        hw};
    auto& fusion = args.epilogue.thread;
    if constexpr (kPass != Pass::kDgrad) {
      fusion.bias_ptr = static_cast<const Element*>(p.bias);
      fusion.aux_ptr = static_cast<Element*>(p.preact);
      fusion.aux_row_stride = p.n;
    } else {
      fusion.saved_ptr = static_cast<const Element*>(p.saved);
      fusion.saved_row_stride = p.n;
      fusion.col_partials = p.col_partials;
      fusion.col_partials_ld = p.n;
    }
    fusion.act.kind = static_cast<int>(p.epilogue);
    if constexpr (kPass == Pass::kDgrad) fusion.act.gated = p.gated;
    return args;
  }

  static size_t workspace_bytes(const Problem& p) { return Gemm::get_workspace_size(arguments(p)); }

  static const char* run(const Problem& p, void* workspace, Stream stream) {
    const auto args = arguments(p);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return "the CUTLASS sm90 kernel cannot implement this problem (alignment or size)";
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
      return "the CUTLASS sm90 kernel failed to initialize";
    if (gemm.run(stream) != cutlass::Status::kSuccess)
      return "the CUTLASS sm90 kernel failed to launch";
    return nullptr;
  }
};

template <class Element, bool kWTransposed, class Config, Pass kPass>
Launcher launcher_of() {
  using K = LinearActGemm<Element, kWTransposed, Config, kPass>;
  return {&K::workspace_bytes, &K::run};
}

// Every tile configuration for one pass, dtype and weight layout; each instantiation file holds
// one (pass, dtype, layout), so the build compiles them in parallel.
template <class Element, bool kWTransposed, Pass kPass>
Launcher launcher_for(Config config) {
  switch (config) {
    case Config::kCoop256x128:
      return launcher_of<Element, kWTransposed, Coop256x128, kPass>();
    case Config::kPingpong128x128:
      return launcher_of<Element, kWTransposed, Pingpong128x128, kPass>();
    case Config::kPingpong64x64:
      return launcher_of<Element, kWTransposed, Pingpong64x64, kPass>();
    case Config::kPingpong128x128Solo:
      return launcher_of<Element, kWTransposed, Pingpong128x128Solo, kPass>();
    default:
      return {};
  }
}

}  // namespace sm90
}  // namespace fastlayers
