"""cuBLASLt's own GELU epilogues, the peer of fastlayers' fused GEMMs, for the benchmarks only.

torch exposes cuBLASLt's GELU epilogue only without its pre-activation output
(torch._addmm_activation) and not its backward at all, so this module builds a small extension
on first use (torch.utils.cpp_extension.load_inline, linked against cuBLASLt) with two calls:

- gelu_aux_bias(x, w, b, y, z): y = gelu_tanh(x w^T + b) and z = x w^T + b (the training
  forward: CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
- dgelu_bgrad(dy, w2, z, dz, db): dz = (dy w2) * gelu_tanh'(z) and db = dz summed over rows
  (the MLP's backward GEMM: CUBLASLT_EPILOGUE_DGELU_BGRAD), with w2 [n2, n] as nn.Linear
  stores FC2's weight.
- wgrad_bgrad(x, g, dw, db, weight_transposed): dw = g^T x (or x^T g, HF Conv1D's [in, out]
  layout) and db = g summed over rows, the bias gradient from the weight-gradient GEMM
  (CUBLASLT_EPILOGUE_BGRADB / BGRADA).

cuBLASLt's GELU is the tanh form only. Row-major tensors are handed to cuBLASLt as their
column-major transposes; descriptors and the heuristic's algorithm are cached per problem.
"""

from __future__ import annotations

import functools

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <map>
#include <tuple>

#define LT_CHECK(expr)                                                                     \
  do {                                                                                     \
    cublasStatus_t status_ = (expr);                                                       \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, #expr " failed: status ", int(status_)); \
  } while (0)

namespace {

constexpr size_t kWorkspace = 32u << 20;

cudaDataType_t lt_type(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "cuBLASLt peer: bfloat16/float16 only");
  return t.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

cublasLtHandle_t handle() {
  static cublasLtHandle_t h = [] {
    cublasLtHandle_t made;
    LT_CHECK(cublasLtCreate(&made));
    return made;
  }();
  return h;
}

// One column-major problem D[rows, cols] = op(A)[rows, k] op(B)[k, cols], its descriptors and
// the heuristic's first algorithm.
struct Plan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, d;
  cublasLtMatmulAlgo_t algo;
};

using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int, int>;

Plan& plan_for(cublasLtEpilogue_t epilogue, cudaDataType_t type, int64_t rows, int64_t cols,
               int64_t k, bool trans_a, bool trans_b = false) {
  static std::map<Key, Plan> plans;
  const Key key{int(epilogue), int(type), rows, cols, k, int(trans_a), int(trans_b)};
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  Plan p;
  LT_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a,
                                          sizeof(op_a)));
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                          sizeof(op_b)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                          sizeof(epilogue)));
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.a, type, trans_a ? k : rows, trans_a ? rows : k,
                                      trans_a ? k : rows));
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.b, type, trans_b ? cols : k, trans_b ? k : cols,
                                      trans_b ? cols : k));
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.d, type, rows, cols, rows));
  // The heuristic needs the epilogue's pointers' alignment only; set them per call.
  const int64_t aux_ld = rows;
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                          sizeof(aux_ld)));
  cublasLtMatmulPreference_t pref;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = kWorkspace;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle(), p.desc, p.a, p.b, p.d, p.d, pref, 1, &result,
                                          &found));
  cublasLtMatmulPreferenceDestroy(pref);
  TORCH_CHECK(found > 0, "cuBLASLt has no algorithm for this epilogue and problem");
  p.algo = result.algo;
  return plans.emplace(key, p).first->second;
}

void run(Plan& p, const void* a, const void* b, void* d, const void* bias, void* aux) {
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                          sizeof(bias)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                          &aux, sizeof(aux)));
  static torch::Tensor workspace;
  if (!workspace.defined())
    workspace = torch::empty({int64_t(kWorkspace)},
                             torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
  const float one = 1.f, zero = 0.f;
  LT_CHECK(cublasLtMatmul(handle(), p.desc, &one, a, p.a, b, p.b, &zero, d, p.d, d, p.d, &p.algo,
                          workspace.data_ptr(), kWorkspace,
                          c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

// y = gelu_tanh(x w^T + b), z = x w^T + b; x [m, k], w [n, k], b [n], y and z [m, n].
// Column-major: D[n, m] = w^T(as stored: [k, n], transposed) . x^T([k, m]).
void gelu_aux_bias(torch::Tensor x, torch::Tensor w, torch::Tensor b, torch::Tensor y,
                   torch::Tensor z) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  Plan& p = plan_for(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, lt_type(x), n, m, k, /*trans_a=*/true);
  run(p, w.data_ptr(), x.data_ptr(), y.data_ptr(), b.data_ptr(), z.data_ptr());
}

// dz = (dy w2) * gelu_tanh'(z), db = column sums of dz; dy [m, n2], w2 [n2, n], z, dz [m, n],
// db [n]. Column-major: D[n, m] = w2(as stored: [n, n2]) . dy^T([n2, m]).
void dgelu_bgrad(torch::Tensor dy, torch::Tensor w2, torch::Tensor z, torch::Tensor dz,
                 torch::Tensor db) {
  const int64_t m = dy.size(0), n2 = dy.size(1), n = w2.size(1);
  Plan& p = plan_for(CUBLASLT_EPILOGUE_DGELU_BGRAD, lt_type(dy), n, m, n2, /*trans_a=*/false);
  run(p, w2.data_ptr(), dy.data_ptr(), dz.data_ptr(), db.data_ptr(), z.data_ptr());
}

// dw = g^T x ([n, k], nn.Linear's layout) or x^T g ([k, n], HF Conv1D's), db = g summed over
// rows; x [m, k], g [m, n]. Column-major, the GEMM's k is m: nn.Linear: D[k, n] = x^T([k, m])
// . g([n, m] transposed), db over D's columns (BGRADB); Conv1D: D[n, k] = g^T([n, m]) . x([k, m]
// transposed), db over D's rows (BGRADA).
void wgrad_bgrad(torch::Tensor x, torch::Tensor g, torch::Tensor dw, torch::Tensor db,
                 bool weight_transposed) {
  const int64_t m = x.size(0), k = x.size(1), n = g.size(1);
  if (weight_transposed) {
    Plan& p = plan_for(CUBLASLT_EPILOGUE_BGRADA, lt_type(x), n, k, m, false, true);
    run(p, g.data_ptr(), x.data_ptr(), dw.data_ptr(), db.data_ptr(), nullptr);
  } else {
    Plan& p = plan_for(CUBLASLT_EPILOGUE_BGRADB, lt_type(x), k, n, m, false, true);
    run(p, x.data_ptr(), g.data_ptr(), dw.data_ptr(), db.data_ptr(), nullptr);
  }
}
"""


@functools.lru_cache(maxsize=1)
def _module():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="fastlayers_cublaslt_peer",
        cpp_sources=_SOURCE,
        functions=["gelu_aux_bias", "dgelu_bgrad", "wgrad_bgrad"],
        with_cuda=True,
        extra_ldflags=["-lcublasLt"],
        verbose=False,
    )


def available() -> str | None:
    """None when the peer builds here, else why not (printed by the benchmarks)."""
    try:
        _module()
    except Exception as err:  # no compiler, no cuBLASLt headers: the benchmark goes on without
        return f"{type(err).__name__}: {err}"
    return None


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not (t.is_cuda and t.is_contiguous()):
            raise ValueError("cuBLASLt peer: CUDA, contiguous tensors only")


def gelu_aux_bias(x, w, b, y, z) -> None:
    """y = gelu_tanh(x w^T + b), z = x w^T + b in one cuBLASLt GEMM (outputs written in place)."""
    _check(x, w, b, y, z)
    _module().gelu_aux_bias(x, w, b, y, z)


def dgelu_bgrad(dy, w2, z, dz, db) -> None:
    """dz = (dy w2) * gelu_tanh'(z), db = dz.sum(0) in one cuBLASLt GEMM (in place)."""
    _check(dy, w2, z, dz, db)
    _module().dgelu_bgrad(dy, w2, z, dz, db)


def wgrad_bgrad(x, g, dw, db, weight_transposed: bool = False) -> None:
    """dw = g^T x (x^T g when weight_transposed) and db = g.sum(0) in one cuBLASLt GEMM."""
    _check(x, g, dw, db)
    _module().wgrad_bgrad(x, g, dw, db, weight_transposed)
