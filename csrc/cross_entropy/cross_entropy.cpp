// cross_entropy_rows_(logits!, target, normaliser, softcap, grad) -> loss per row (float32)
//
// logits [rows, V] (float32, float16 or bfloat16, contiguous), target [rows] int64 in [0, V),
// normaliser a float32 scalar tensor (the mean's count or num_items_in_batch), softcap 0 for
// none. Each row's loss is logsumexp(z) - z[target] with z the (soft-capped) logits in float32,
// as F.cross_entropy computes it on ForCausalLMLoss's float32 upcast. With grad, the row is
// overwritten with d(sum of losses / normaliser)/d(logits), rounded as native's chain rounds
// it: the upcast's backward rounds (softmax - onehot) / normaliser to the logits' dtype, then
// the cap's backward runs in that dtype (multiply, tanh's backward, divide). The linear +
// cross-entropy op (fastlayers/ops/linear_cross_entropy.py) calls it on each chunk of logits.
#include "cross_entropy/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "common/common.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.cross_entropy_rows_";

void check_args(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& normaliser) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), kOp,
              ": logits must be a contiguous [rows, vocabulary] tensor");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kHalf ||
                  logits.scalar_type() == at::kBFloat16,
              kOp, ": logits must be float32, float16 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0) &&
                  target.scalar_type() == at::kLong,
              kOp, ": target must be int64 [rows]");
  TORCH_CHECK(normaliser.numel() == 1 && normaliser.scalar_type() == at::kFloat, kOp,
              ": normaliser must be a float32 scalar tensor");
  check_same_device(target, logits, kOp, "target", "logits");
  check_same_device(normaliser, logits, kOp, "normaliser", "logits");
}

at::Tensor cross_entropy_rows_cpu(at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& normaliser, double softcap, bool grad) {
  check_args(logits, target, normaliser);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor loss = at::empty({rows}, logits.options().dtype(at::kFloat));
  const float norm = normaliser.item<float>();
  const float cap = static_cast<float>(softcap);
  const int64_t* t = target.data_ptr<int64_t>();
  float* out = loss.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), kOp, [&] {
    using M = CrossEntropyMath<scalar_t>;
    scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = x + r * vocab;
        TORCH_CHECK(t[r] >= 0 && t[r] < vocab, kOp, ": target ", t[r], " outside [0, ", vocab,
                    ")");
        float capped = 0.0f, m = -std::numeric_limits<float>::infinity();
        double s = 0.0;  // as the CUDA kernel: float32 terms summed in float64
        for (int64_t j = 0; j < vocab; ++j) {
          const float z = M::logit(row[j], cap, &capped);
          if (z > m) {
            s = s * static_cast<double>(std::exp(m - z)) + 1.0;
            m = z;
          } else {
            s += static_cast<double>(std::exp(z - m));
          }
        }
        const float log_sum = static_cast<float>(std::log(s));
        out[r] = log_sum - (M::logit(row[t[r]], cap, &capped) - m);
        if (!grad) continue;
        for (int64_t j = 0; j < vocab; ++j) {
          const float z = M::logit(row[j], cap, &capped);
          row[j] = M::grad(z, m, log_sum, j == t[r], norm, cap, capped);
        }
      }
    });
  });
  return loss;
}

at::Tensor cross_entropy_rows_meta(at::Tensor& logits, const at::Tensor& target,
                                   const at::Tensor& normaliser, double softcap, bool grad) {
  return at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def(
      "cross_entropy_rows_(Tensor(a!) logits, Tensor target, Tensor normaliser, float softcap, "
      "bool grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) { m.impl("cross_entropy_rows_", &cross_entropy_rows_cpu); }

TORCH_LIBRARY_IMPL(fastlayers, Meta, m) {
  m.impl("cross_entropy_rows_", &cross_entropy_rows_meta);
}

}  // namespace fastlayers
