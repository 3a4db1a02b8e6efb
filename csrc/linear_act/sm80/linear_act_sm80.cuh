// The sm_80 GEMM of the Linear + activation family: CUTLASS 2.x's multistage (cp.async) mainloop on
// mma.sync tensor cores, with the broadcast epilogue (EpilogueWithBroadcast): z = acc + bias (the
// bias a row vector), optionally stored (the pre-activation GELU's backward needs), and act(z)
// written. Included only by the per-dtype instantiation files linear_act_sm80_*.cu.
// Bias and pre-activation are optional at run time (null pointers: CUTLASS then reads zeros and
// skips the stores), and the activation is a run-time argument, so one kernel per (dtype, weight
// layout, tile config) serves every call.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/device/gemm_universal_with_broadcast.h>
#include <cutlass/numeric_conversion.h>

#include "linear_act/gelu_epilogue.cuh"
#include "linear_act/sm80/linear_act_sm80.h"

namespace fastlayers {
namespace sm80 {

// The epilogue's per-element operation (EpilogueWithBroadcast's output-op concept): from the
// accumulators AB and the bias V, z = AB + V (T, the pre-activation) and act(z) (Z, the output).
// Written here rather than taken from CUTLASS's LinearCombinationBiasElementwise so that the
// activation is chosen once per fragment, outside the element loop (a per-element branch keeps
// the compiler from interleaving the elements' MUFU latencies), and no alpha/beta is applied.
template <class Element, int kElements>
class BiasActivation {
 public:
  using ElementOutput = Element;
  using ElementD = Element;
  using ElementC = Element;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementZ = Element;
  using ElementT = Element;
  using ElementVector = Element;
  static int const kElementsPerAccess = kElements;
  static int const kCount = kElements;
  static bool const kIsSingleSource = true;
  // the GELU forms are a few MUFU and FFMA operations per element: CUTLASS then processes one
  // fragment per iteration (fewer live registers)
  static bool const kIsHeavy = true;
  static bool const kStoreZ = true;
  static bool const kStoreT = true;  // masked off when the pre-activation pointer is null

  using FragmentAccumulator = cutlass::Array<float, kElements>;
  using FragmentCompute = cutlass::Array<float, kElements>;
  using FragmentC = cutlass::Array<Element, kElements>;
  using FragmentZ = cutlass::Array<Element, kElements>;
  using FragmentT = cutlass::Array<Element, kElements>;
  using FragmentSource = FragmentC;
  using FragmentOutput = FragmentZ;

  struct Params {
    int kind = static_cast<int>(Activation::kGeluErf);
  };

  CUTLASS_HOST_DEVICE explicit BiasActivation(Params const& params) : kind_(params.kind) {}

  // No source tensor C: the bias comes as the broadcast vector.
  CUTLASS_HOST_DEVICE bool is_source_needed() const { return false; }

  // Serial split-K is never launched (the dispatch runs one k partition).
  CUTLASS_HOST_DEVICE void set_k_partition(int, int) {}

  CUTLASS_DEVICE void operator()(FragmentZ& frag_z, FragmentT& frag_t,
                                 FragmentAccumulator const& ab, FragmentCompute const& v) const {
    FragmentCompute z, y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kElements; ++i) z[i] = ab[i] + v[i];
    if (kind_ == static_cast<int>(Activation::kGeluErf)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kElements; ++i) y[i] = gelu_epilogue::gelu_erf(z[i]);
    } else if (kind_ == static_cast<int>(Activation::kGeluTanh)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kElements; ++i) y[i] = gelu_epilogue::gelu_tanh(z[i]);
    } else if (kind_ == static_cast<int>(Activation::kReLU)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kElements; ++i) y[i] = relu_value(z[i]);
    } else {
      y = z;
    }
    frag_z = cutlass::NumericArrayConverter<Element, float, kElements>()(y);
    frag_t = cutlass::NumericArrayConverter<Element, float, kElements>()(z);
  }

  // The source-needed form, never taken (is_source_needed() is false) but instantiated.
  CUTLASS_DEVICE void operator()(FragmentZ& frag_z, FragmentT& frag_t,
                                 FragmentAccumulator const& ab, FragmentC const&,
                                 FragmentCompute const& v) const {
    (*this)(frag_z, frag_t, ab, v);
  }

 private:
  int kind_;
};

template <class Element, bool kWTransposed, Config kConfig>
struct LinearActGemm {
  static constexpr Tile kTile = tile_of(kConfig);
  static constexpr int kAlign = 8;  // 16 bytes of 16-bit elements
  // x [m, k] row-major; the GEMM's B is W^T [k, n]: column-major when w is [n, k] row-major,
  // row-major when stored transposed ([k, n], Conv1D)
  using LayoutB = std::conditional_t<kWTransposed, cutlass::layout::RowMajor,
                                     cutlass::layout::ColumnMajor>;
  using Gemm = cutlass::gemm::device::GemmUniversalWithBroadcast<
      Element, cutlass::layout::RowMajor, Element, LayoutB, Element, cutlass::layout::RowMajor,
      float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<kTile.m, kTile.n, kTile.k>,
      cutlass::gemm::GemmShape<kTile.m / kTile.warps_m, kTile.n / kTile.warps_n, kTile.k>,
      cutlass::gemm::GemmShape<16, 8, 16>, BiasActivation<Element, kAlign>,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, kTile.stages, kAlign,
      kAlign>;

  static typename Gemm::Arguments arguments(const Problem& p) {
    typename BiasActivation<Element, kAlign>::Params epilogue;
    epilogue.kind = static_cast<int>(p.epilogue);
    const int64_t ldb = kWTransposed ? p.n : p.k;
    return typename Gemm::Arguments(
        cutlass::gemm::GemmUniversalMode::kGemm, {p.m, p.n, p.k}, /*batch_count=*/1, epilogue,
        p.x, p.w, /*ptr_C=*/nullptr, p.y, const_cast<void*>(p.bias), p.preact,
        /*batch strides A, B, C, D, Vector, Tensor=*/0, 0, 0, 0, 0, 0, /*lda=*/p.k, ldb,
        /*ldc=*/p.n, /*ldd=*/p.n, /*ldr (bias: one row for all)=*/0, /*ldt=*/p.n);
  }

  static size_t workspace_bytes(const Problem& p) { return Gemm::get_workspace_size(arguments(p)); }

  static const char* run(const Problem& p, void* workspace, Stream stream) {
    const auto args = arguments(p);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return "the CUTLASS sm80 kernel cannot implement this problem (alignment or size)";
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
      return "the CUTLASS sm80 kernel failed to initialize (shared memory?)";
    if (gemm.run(stream) != cutlass::Status::kSuccess)
      return "the CUTLASS sm80 kernel failed to launch";
    return nullptr;
  }
};

template <class Element, bool kWTransposed, Config kConfig>
Launcher launcher_of() {
  using K = LinearActGemm<Element, kWTransposed, kConfig>;
  return {&K::workspace_bytes, &K::run};
}

template <class Element, bool kWTransposed>
Launcher launcher_for(Config config) {
  switch (config) {
    case Config::kTile128x256:
      return launcher_of<Element, kWTransposed, Config::kTile128x256>();
    case Config::kTile128x128:
      return launcher_of<Element, kWTransposed, Config::kTile128x128>();
    case Config::kTile64x64:
      return launcher_of<Element, kWTransposed, Config::kTile64x64>();
    default:
      return {};
  }
}

}  // namespace sm80
}  // namespace fastlayers
