// The sm_90a fused Linear + bias + activation GEMM: a CUTLASS 3 TMA warp-specialised kernel
// (wgmma mainloop) whose epilogue computes z = acc + bias, optionally stores z (the
// pre-activation that GELU's backward needs), and writes act(z). Included only by the per-dtype
// instantiation files.
//
// The epilogue is a CUTLASS epilogue visitor tree: Act(AuxStore(plus(acc, RowBroadcast bias))).
// Bias and aux are optional at run time (null pointers), and the activation (GELU erf/tanh,
// ReLU) is a run-time argument, so one kernel per (dtype, weight layout, tile config) serves
// every call.
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

#include "gelu_epilogue.cuh"
#include "linear_act_sm90.h"

namespace fastlayers {
namespace sm90 {

struct EpilogueArgs {
  int kind = static_cast<int>(Activation::kGeluErf);
};

// GELU by the epilogue's MUFU forms (gelu_epilogue.cuh); ReLU by the shared relu_value.
CUTLASS_DEVICE float apply_epilogue(float z, int kind) {
  if (kind == static_cast<int>(Activation::kGeluErf)) return gelu_epilogue::gelu_erf(z);
  if (kind == static_cast<int>(Activation::kGeluTanh)) return gelu_epilogue::gelu_tanh(z);
  if (kind == static_cast<int>(Activation::kReLU)) return relu_value(z);
  return z;
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

// Fusion tag: D = act(acc + bias[col]); Aux = acc + bias[col] (row-major, like D). Declaring the
// aux output lets CUTLASS's epilogue builder pick the aux shared-memory layout and copy atom.
template <class Element>
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

// The visitor tree of BiasActAux: act(AuxStore(acc + RowBroadcast(bias))).
template <int StagesD, class Element, class CtaTileShapeMNK, class EpilogueTile, class SmemLayoutAtom,
          class CopyOpR2S>
using BiasActAuxTree = Sm90EVT<
    Sm90Compute<fastlayers::sm90::EpilogueFn, Element, float, FloatRoundStyle::round_to_nearest>,
    Sm90EVT<Sm90AuxStore<StagesD, EpilogueTile, Element, FloatRoundStyle::round_to_nearest,
                         cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>, SmemLayoutAtom,
                         CopyOpR2S>,
            Sm90EVT<Sm90Compute<cutlass::plus, float, float, FloatRoundStyle::round_to_nearest>,
                    Sm90AccFetch,
                    Sm90RowBroadcast<0, CtaTileShapeMNK, Element, float,
                                     cute::Stride<cute::_0, cute::_1, int64_t>>>>>;

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore,
          class Element, class CtaTileShapeMNK, class EpilogueTile, class SmemLayoutAtom,
          class CopyOpR2S>
struct FusionCallbacks<
    epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
    fastlayers::sm90::BiasActAux<Element>, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom,
    CopyOpR2S>
    : BiasActAuxTree<StagesD, Element, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom, CopyOpR2S> {
  using Impl =
      BiasActAuxTree<StagesD, Element, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom, CopyOpR2S>;
  using Operation = fastlayers::sm90::BiasActAux<Element>;

  struct Arguments {
    Element const* bias_ptr = nullptr;
    Element* aux_ptr = nullptr;
    int64_t aux_row_stride = 0;
    fastlayers::sm90::EpilogueArgs act{};

    operator typename Impl::Arguments() const {
      using StrideAux = cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>;
      return {                           // act(store(acc + bias))
              {                          // store(acc + bias)
               {                         // acc + bias
                {},                      // acc
                {bias_ptr, Element(0), {}},  // bias[col], 0 when null
                {}},                     // plus
               {aux_ptr, StrideAux{aux_row_stride, cute::_1{}, 0}}},
              act};
    }
  };

  using Impl::Impl;
};

}  // namespace cutlass::epilogue::fusion

namespace fastlayers {
namespace sm90 {

template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_,
          class EpilogueTile_ = cutlass::epilogue::collective::EpilogueTileAuto>
struct TileConfig {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = KernelSchedule_;
  using EpilogueSchedule = EpilogueSchedule_;
  using EpilogueTile = EpilogueTile_;
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

using Coop256x128 =
    TileConfig<cute::Shape<_256, _128, _64>, Cluster2x1, Coop, CoopEpilogue>;
// Ping-pong with wider epilogue subtiles than the builder's choice (64x32): fewer store round
// trips per tile and more independent elements per thread, so the epilogue fits under the other
// warp group's mainloop (measured: 8192x768->3072 erf 84.4 -> 76.6 us; 64x128 gained nothing).
using Pingpong128x128 = TileConfig<cute::Shape<_128, _128, _64>, Cluster2x1, Pingpong,
                                   PingpongEpilogue, cute::Shape<_64, _64>>;

// The GEMM D[m, n] = A[m, k] . B[k, n] with A = x (row-major, K-major) and B = W^T: W [n, k]
// row-major is a K-major B (ColumnMajor); W^T stored [k, n] row-major is an N-major B.
template <class Element, bool kWTransposed, class Config>
struct FusedLinearAct {
  static constexpr int kAlign = 128 / cutlass::sizeof_bits_v<Element>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB =
      std::conditional_t<kWTransposed, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  using LayoutD = cutlass::layout::RowMajor;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape,
      typename Config::ClusterShape, typename Config::EpilogueTile, float, float,
      void, LayoutD, kAlign, Element, LayoutD, kAlign, typename Config::EpilogueSchedule,
      BiasActAux<Element>>::CollectiveOp;

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
    fusion.bias_ptr = static_cast<const Element*>(p.bias);
    fusion.aux_ptr = static_cast<Element*>(p.preact);
    fusion.aux_row_stride = p.n;
    fusion.act.kind = static_cast<int>(p.epilogue);
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

template <class Element, bool kWTransposed, class Config>
Launcher launcher_of() {
  using K = FusedLinearAct<Element, kWTransposed, Config>;
  return {&K::workspace_bytes, &K::run};
}

// Every tile configuration for one dtype and weight layout; each instantiation file holds one
// (dtype, layout) pair, so the build compiles them in parallel.
template <class Element, bool kWTransposed>
Launcher launcher_for(Config config) {
  switch (config) {
    case Config::kCoop256x128:
      return launcher_of<Element, kWTransposed, Coop256x128>();
    case Config::kPingpong128x128:
      return launcher_of<Element, kWTransposed, Pingpong128x128>();
    default:
      return {};
  }
}

}  // namespace sm90
}  // namespace fastlayers
