// LayerNorm op family: schemas, argument checks, CPU kernels, autograd and autocast.
//
//   layer_norm_fwd(input, normalized_shape, weight?, bias?, eps, out_dtype?) -> (y, mean, rstd)
//   layer_norm_bwd(grad_out, input, mean, rstd, normalized_shape, weight?, bias?, output_mask)
//       -> (grad_input, grad_weight, grad_bias); an output not asked for is an empty tensor.
//
// Autograd is registered here in C++ (Autograd key), so a call costs no Python glue.
#include "layer_norm/layer_norm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <cmath>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.layer_norm";

void check_param(const std::optional<at::Tensor>& p, const char* arg, const at::Tensor& input,
                 at::IntArrayRef normalized_shape) {
  if (!p.has_value() || !p->defined()) return;
  check_same_device(*p, input, kOp, arg, "input");
  check_param_dtype(*p, input, kOp, arg);
  TORCH_CHECK(p->sizes() == normalized_shape, kOp, ": ", arg, " has shape ",
              shape_str(p->sizes()), " but normalized_shape is ", shape_str(normalized_shape));
}
}  // namespace

RowsCols check_layer_norm_args(const at::Tensor& input, at::IntArrayRef normalized_shape,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias,
                               std::optional<at::ScalarType> out_dtype) {
  check_input_dtype(input, kOp, "input");
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1, kOp, ": normalized_shape must have at least one dimension");
  TORCH_CHECK(input.dim() >= k && input.sizes().slice(input.dim() - k) == normalized_shape, kOp,
              ": input of shape ", shape_str(input.sizes()), " does not end with normalized_shape ",
              shape_str(normalized_shape));
  check_param(weight, "weight", input, normalized_shape);
  check_param(bias, "bias", input, normalized_shape);
  if (out_dtype.has_value()) {
    const at::ScalarType in = input.scalar_type();
    TORCH_CHECK(*out_dtype == in || (*out_dtype == at::kFloat && in != at::kDouble), kOp,
                ": out_dtype must be the input's dtype or float32 (float64 inputs: float64), got ",
                *out_dtype);
  }
  int64_t cols = 1;
  for (int64_t s : normalized_shape) cols *= s;
  TORCH_CHECK(cols <= std::numeric_limits<int32_t>::max(), kOp,
              ": normalized_shape has more than 2^31-1 elements");
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  return {rows, cols};
}

RowsCols check_layer_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                        const at::Tensor& mean, const at::Tensor& rstd,
                                        at::IntArrayRef normalized_shape,
                                        const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& bias) {
  RowsCols rc = check_layer_norm_args(input, normalized_shape, weight, bias, std::nullopt);
  check_input_dtype(grad_out, kOp, "grad_out");
  check_same_device(grad_out, input, kOp, "grad_out", "input");
  TORCH_CHECK(grad_out.sizes() == input.sizes(), kOp, ": grad_out has shape ",
              shape_str(grad_out.sizes()), " but input has shape ", shape_str(input.sizes()));
  const at::ScalarType in = input.scalar_type();
  TORCH_CHECK(grad_out.scalar_type() == in || (grad_out.scalar_type() == at::kFloat &&
                                               in != at::kDouble),
              kOp, ": grad_out must have the input's dtype or float32 (float64 inputs: float64), ",
              "got ", grad_out.scalar_type());
  const at::ScalarType stat_dtype = layer_norm_stat_dtype(in);
  for (const at::Tensor* stat : {&mean, &rstd}) {
    const char* name = stat == &mean ? "mean" : "rstd";
    check_same_device(*stat, input, kOp, name, "input");
    TORCH_CHECK(stat->scalar_type() == stat_dtype && stat->numel() == rc.rows, kOp, ": ", name,
                " must be a ", stat_dtype == at::kDouble ? "float64" : "float32", " tensor of ",
                std::to_string(rc.rows), " elements (one per row)");
  }
  return rc;
}

LayerNormOutputs empty_forward_outputs(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                       std::optional<at::ScalarType> out_dtype) {
  auto sizes = input.sizes();
  const std::vector<int64_t> stat_shape(sizes.begin(), sizes.end() - normalized_shape.size());
  const auto stat_opts = input.options().dtype(layer_norm_stat_dtype(input.scalar_type()));
  return {at::empty(sizes, input.options().dtype(out_dtype.value_or(input.scalar_type()))),
          at::empty(stat_shape, stat_opts), at::empty(stat_shape, stat_opts)};
}

// ---------------------------------------------------------------------------------------------
// CPU kernels for the calls ATen's kernels do not take as they are (aten_cpu_stat_dtype below):
// statistics accumulated in double per row; the same formulas as the CUDA kernels.
namespace {

// Parameters as contiguous float32 (they are small: one value per column).
at::Tensor param_as_float(const std::optional<at::Tensor>& p) {
  if (!p.has_value() || !p->defined()) return at::Tensor();
  return p->contiguous().to(at::kFloat);
}

// Sum of f(j) for j in [0, cols) in double, in kLanes independent partial sums combined in a
// fixed order: one serial chain of double adds would bound the kernels by add latency.
constexpr int64_t kLanes = 8;

template <typename F>
double row_sum(int64_t cols, F f) {
  double part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= cols; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += f(j + l);
  for (; j < cols; ++j) part[0] += f(j);
  double sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

template <typename T, typename O>
void fwd_cpu_kernel(const T* x, const float* w, const float* b, O* y, float* mean, float* rstd,
                    int64_t rows, int64_t cols, double eps) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * cols;
      const double mu = row_sum(cols, [&](int64_t j) { return double(float(xr[j])); }) / cols;
      const double m2 = row_sum(cols, [&](int64_t j) {
        const double d = static_cast<float>(xr[j]) - mu;
        return d * d;
      });
      const float mu_f = static_cast<float>(mu);
      const float rs = static_cast<float>(1.0 / std::sqrt(m2 / cols + eps));
      mean[r] = mu_f;
      rstd[r] = rs;
      O* yr = y + r * cols;
      // Branches hoisted so that each loop vectorises.
      if (w && b) {
        for (int64_t j = 0; j < cols; ++j)
          yr[j] = static_cast<O>((static_cast<float>(xr[j]) - mu_f) * rs * w[j] + b[j]);
      } else if (w) {
        for (int64_t j = 0; j < cols; ++j)
          yr[j] = static_cast<O>((static_cast<float>(xr[j]) - mu_f) * rs * w[j]);
      } else {
        for (int64_t j = 0; j < cols; ++j) {
          const float v = (static_cast<float>(xr[j]) - mu_f) * rs;
          yr[j] = static_cast<O>(b ? v + b[j] : v);
        }
      }
    }
  });
}

// Rows per chunk of the dweight/dbias partial sums: fixed, so the result does not depend on
// the number of threads (bit-identical gradients on every run).
constexpr int64_t kRowsPerChunk = 64;

template <typename T, typename G>
void bwd_cpu_kernel(const G* dy, const T* x, const float* mean, const float* rstd, const float* w,
                    T* dx, float* dw_part, float* db_part, int64_t rows, int64_t cols) {
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
    for (int64_t c = cbegin; c < cend; ++c) {
      float* dwp = dw_part ? dw_part + c * cols : nullptr;
      float* dbp = db_part ? db_part + c * cols : nullptr;
      const int64_t rend = std::min(rows, (c + 1) * kRowsPerChunk);
      for (int64_t r = c * kRowsPerChunk; r < rend; ++r) {
        const T* xr = x + r * cols;
        const G* gr = dy + r * cols;
        const float mu = mean[r], rs = rstd[r];
        if (dx) {
          auto g_at = [&](int64_t j) { return static_cast<float>(gr[j]) * (w ? w[j] : 1.f); };
          const double sum_g = row_sum(cols, [&](int64_t j) { return double(g_at(j)); });
          const double sum_gx = row_sum(cols, [&](int64_t j) {
            return static_cast<double>(g_at(j)) * ((static_cast<float>(xr[j]) - mu) * rs);
          });
          const float c1 = static_cast<float>(sum_gx / cols), c2 = static_cast<float>(sum_g / cols);
          T* dxr = dx + r * cols;
          for (int64_t j = 0; j < cols; ++j) {
            const float xhat = (static_cast<float>(xr[j]) - mu) * rs;
            const float g = static_cast<float>(gr[j]) * (w ? w[j] : 1.f);
            dxr[j] = static_cast<T>(rs * (g - xhat * c1 - c2));
          }
        }
        for (int64_t j = 0; j < cols && (dwp || dbp); ++j) {
          const float g = static_cast<float>(gr[j]);
          if (dwp) dwp[j] += g * ((static_cast<float>(xr[j]) - mu) * rs);
          if (dbp) dbp[j] += g;
        }
      }
    }
  });
}

// Sums partial[chunks, cols] over chunks in a fixed order into a [cols] tensor of `dtype`.
at::Tensor sum_partials_cpu(const at::Tensor& partial, at::ScalarType dtype) {
  const int64_t chunks = partial.size(0), cols = partial.size(1);
  at::Tensor out = at::empty({cols}, partial.options());
  const float* p = partial.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, cols, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      float s = 0;
      for (int64_t c = 0; c < chunks; ++c) s += p[c * cols + j];
      o[j] = s;
    }
  });
  return out.to(dtype);
}

// ATen's CPU layer_norm kernels (torch.nn.LayerNorm's own on CPU: native's very numbers, and
// 2x (float32) to 20x (float16) faster than the kernels above on one core, vectorised; measured
// by benchmarks/bench_cpu.py) take every call they compute as it is: y in the input's dtype, and
// parameters all of the input's dtype or, under a half/bf16 input, all float32 (ATen's "mixed
// type" path). Returns the dtype of ATen's mean/rstd for such a call (mixed: float32, else the
// input's), or nullopt for the rest (one parameter float32 and one not, a float32 y or grad_out
// under a half input, empty rows), which the kernels above run.
std::optional<at::ScalarType> aten_cpu_stat_dtype(const at::Tensor& input,
                                                  const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  at::ScalarType y_dtype, const RowsCols& rc) {
  const at::ScalarType in = input.scalar_type();
  if (y_dtype != in || rc.rows == 0 || rc.cols == 0) return std::nullopt;
  std::optional<at::ScalarType> param_dtype;
  for (const std::optional<at::Tensor>* p : {&weight, &bias}) {
    if (!p->has_value() || !(*p)->defined()) continue;
    if (param_dtype.has_value() && *param_dtype != (*p)->scalar_type()) return std::nullopt;
    param_dtype = (*p)->scalar_type();
  }
  return param_dtype.value_or(in);  // check_param_dtype: the input's dtype or float32
}

LayerNormOutputs layer_norm_fwd_cpu(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias, double eps,
                                    std::optional<at::ScalarType> out_dtype) {
  const RowsCols rc = check_layer_norm_args(input, normalized_shape, weight, bias, out_dtype);
  const at::ScalarType y_dtype = out_dtype.value_or(input.scalar_type());
  if (aten_cpu_stat_dtype(input, weight, bias, y_dtype, rc).has_value()) {
    auto [y, amean, arstd] = at::native_layer_norm(input, normalized_shape, weight, bias, eps);
    // ATen's statistics are shaped [leading..., 1, ...] and may be bf16/fp16 (exact in float32):
    // reshaped in place where their dtype is already ours (an _unsafe_view, so that no output
    // is marked as a view of a temporary), else copied into ours.
    const auto stat_shape = input.sizes().slice(0, input.dim() - normalized_shape.size());
    const at::ScalarType stat_dtype = layer_norm_stat_dtype(input.scalar_type());
    const auto as_stat = [&](const at::Tensor& t) {
      if (t.scalar_type() == stat_dtype && t.is_contiguous()) return at::_unsafe_view(t, stat_shape);
      at::Tensor out = at::empty(stat_shape, input.options().dtype(stat_dtype));
      out.copy_(t.view(stat_shape));
      return out;
    };
    return {y, as_stat(amean), as_stat(arstd)};
  }
  at::Tensor y, mean, rstd;  // not a structured binding: C++17 lambdas cannot capture one
  std::tie(y, mean, rstd) = empty_forward_outputs(input, normalized_shape, out_dtype);
  const at::Tensor x = input.contiguous();
  if (rc.rows == 0) return {y, mean, rstd};
  const at::Tensor w = param_as_float(weight), b = param_as_float(bias);
  dispatch_dtype(x.scalar_type(), kOp, [&](auto in_tag) {
    using T = typename decltype(in_tag)::type;
    dispatch_dtype(y.scalar_type(), kOp, [&](auto out_tag) {
      using O = typename decltype(out_tag)::type;
      fwd_cpu_kernel<T, O>(x.data_ptr<T>(), w.defined() ? w.data_ptr<float>() : nullptr,
                           b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<O>(),
                           mean.data_ptr<float>(), rstd.data_ptr<float>(), rc.rows, rc.cols, eps);
    });
  });
  return {y, mean, rstd};
}

LayerNormOutputs layer_norm_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& input,
                                    const at::Tensor& mean, const at::Tensor& rstd,
                                    at::IntArrayRef normalized_shape,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias,
                                    std::array<bool, 3> output_mask) {
  const RowsCols rc = check_layer_norm_backward_args(grad_out, input, mean, rstd,
                                                     normalized_shape, weight, bias);
  const bool want_dw = output_mask[1] && weight.has_value() && weight->defined();
  const bool want_db = output_mask[2] && bias.has_value() && bias->defined();
  const auto stat_dtype = aten_cpu_stat_dtype(input, weight, bias, grad_out.scalar_type(), rc);
  if (stat_dtype.has_value()) {
    // The forward took ATen's kernel too: its statistics go back in ATen's dtype (exactly).
    auto [dx, dw, db] = at::native_layer_norm_backward(
        grad_out.contiguous(), input, normalized_shape, mean.contiguous().to(*stat_dtype),
        rstd.contiguous().to(*stat_dtype), weight, bias, {output_mask[0], want_dw, want_db});
    const auto or_empty = [&](bool want, const at::Tensor& t) {
      return want ? t : at::empty({0}, input.options());
    };
    return {or_empty(output_mask[0], dx), or_empty(want_dw, dw), or_empty(want_db, db)};
  }
  const at::Tensor x = input.contiguous(), dy = grad_out.contiguous();
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const at::Tensor w = param_as_float(weight);
  at::Tensor dx = output_mask[0] ? at::empty(input.sizes(), input.options())
                                 : at::empty({0}, input.options());
  const int64_t chunks = (rc.rows + kRowsPerChunk - 1) / kRowsPerChunk;
  const auto fopts = input.options().dtype(at::kFloat);
  at::Tensor dw_part = want_dw ? at::zeros({chunks, rc.cols}, fopts) : at::Tensor();
  at::Tensor db_part = want_db ? at::zeros({chunks, rc.cols}, fopts) : at::Tensor();
  if (rc.rows > 0) {
    dispatch_dtype(x.scalar_type(), kOp, [&](auto in_tag) {
      using T = typename decltype(in_tag)::type;
      dispatch_dtype(dy.scalar_type(), kOp, [&](auto g_tag) {
        using G = typename decltype(g_tag)::type;
        bwd_cpu_kernel<T, G>(dy.data_ptr<G>(), x.data_ptr<T>(), mean_c.data_ptr<float>(),
                             rstd_c.data_ptr<float>(), w.defined() ? w.data_ptr<float>() : nullptr,
                             output_mask[0] ? dx.data_ptr<T>() : nullptr,
                             want_dw ? dw_part.data_ptr<float>() : nullptr,
                             want_db ? db_part.data_ptr<float>() : nullptr, rc.rows, rc.cols);
      });
    });
  }
  auto finish = [&](bool want, const at::Tensor& part, const std::optional<at::Tensor>& p) {
    if (!want) return at::empty({0}, input.options());
    return sum_partials_cpu(part, p->scalar_type()).view(normalized_shape);
  };
  return {dx, finish(want_dw, dw_part, weight), finish(want_db, db_part, bias)};
}

// ---------------------------------------------------------------------------------------------
// Autograd (C++, a FusedNode): forward saves input, weight, bias, mean, rstd; backward calls
// layer_norm_bwd.

}  // namespace

const c10::TypedOperatorHandle<LayerNormFwdSig>& layer_norm_fwd_op() {
  static const auto op = find_op<LayerNormFwdSig>("fastlayers::layer_norm_fwd");
  return op;
}

const c10::TypedOperatorHandle<LayerNormBwdSig>& layer_norm_bwd_op() {
  static const auto op = find_op<LayerNormBwdSig>("fastlayers::layer_norm_bwd");
  return op;
}

at::Tensor layer_norm_eager(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps) {
  return std::get<0>(
      layer_norm_fwd_op().call(input, normalized_shape, weight, bias, eps, std::nullopt));
}

namespace {

// Backward of layer_norm_fwd: saves input, weight, bias, mean, rstd; calls layer_norm_bwd.
class LayerNormBackward : public FusedNode {
 public:
  SavedVariable input, weight, bias, mean, rstd;

  std::string name() const override { return "fastlayers::LayerNormBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "torch.nn.functional.layer_norm");
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor x = unpack(input), m = unpack(mean), r = unpack(rstd);
    const std::optional<at::Tensor> w = unpack_optional(weight), b = unpack_optional(bias);
    // normalized_shape is not saved: it is input's shape after mean's dimensions.
    const at::IntArrayRef normalized_shape = x.sizes().slice(m.dim());
    const std::array<bool, 3> mask = {should_compute_output(0),
                                      w.has_value() && should_compute_output(1),
                                      b.has_value() && should_compute_output(2)};
    auto [dx, dw, db] = layer_norm_bwd_op().call(dy, x, m, r, normalized_shape, w, b, mask);
    return {mask[0] ? dx : at::Tensor(), mask[1] ? dw : at::Tensor(),
            mask[2] ? db : at::Tensor()};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&input, &weight, &bias, &mean, &rstd}; }
};

LayerNormOutputs layer_norm_fwd_autograd(const at::Tensor& input,
                                         at::IntArrayRef normalized_shape,
                                         const std::optional<at::Tensor>& weight,
                                         const std::optional<at::Tensor>& bias, double eps,
                                         std::optional<at::ScalarType> out_dtype) {
  if (!records_grad(input, weight, bias)) {
    // Nothing to record: skip the autograd node and its bookkeeping (inference host time).
    at::AutoDispatchBelowADInplaceOrView guard;
    return layer_norm_fwd_op().call(input, normalized_shape, weight, bias, eps, out_dtype);
  }
  NodePtr node_ptr = make_node<LayerNormBackward>();
  auto* node = static_cast<LayerNormBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  LayerNormOutputs out = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return layer_norm_fwd_op().call(input, normalized_shape, weight, bias, eps, out_dtype);
  }();
  const auto& [y, mean, rstd] = out;
  torch::autograd::set_history(y, node_ptr);  // mean and rstd get no gradient
  node->input = SavedVariable(input, false);
  node->weight = SavedVariable(weight, false);
  node->bias = SavedVariable(bias, false);
  node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  return out;
}

// layer_norm_bwd is not differentiable (LayerNormFunction::backward refuses create_graph); this
// kernel only steps below autograd, sparing the boxed default fallback on every backward.
LayerNormOutputs layer_norm_bwd_autograd(const at::Tensor& grad_out, const at::Tensor& input,
                                         const at::Tensor& mean, const at::Tensor& rstd,
                                         at::IntArrayRef normalized_shape,
                                         const std::optional<at::Tensor>& weight,
                                         const std::optional<at::Tensor>& bias,
                                         std::array<bool, 3> output_mask) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return layer_norm_bwd_op().call(grad_out, input, mean, rstd, normalized_shape, weight, bias,
                                  output_mask);
}

// CUDA autocast puts layer_norm on its float32 list: torch.nn.LayerNorm then returns float32.
// We match that output dtype and those numerics (a bf16/fp16 -> fp32 cast is exact), but read
// the half-precision input directly instead of materialising a float32 copy of it.
LayerNormOutputs layer_norm_fwd_autocast_cuda(const at::Tensor& input,
                                              at::IntArrayRef normalized_shape,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& bias, double eps,
                                              std::optional<at::ScalarType> out_dtype) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  auto as_eligible = [&](const std::optional<at::Tensor>& p) -> std::optional<at::Tensor> {
    if (!p.has_value() || !p->defined() || !p->is_floating_point()) return p;
    if (p->scalar_type() == input.scalar_type() || p->scalar_type() == at::kFloat) return p;
    return p->to(at::kFloat);  // autocast would cast it to float32 as well
  };
  const bool is_cuda_half = input.is_cuda() && (input.scalar_type() == at::kHalf ||
                                                input.scalar_type() == at::kBFloat16);
  std::optional<at::ScalarType> od = out_dtype;
  if (!od.has_value() && is_cuda_half) od = at::kFloat;
  return layer_norm_fwd_op().call(input, normalized_shape, as_eligible(weight),
                                  as_eligible(bias), eps, od);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def(
      "layer_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float eps, ScalarType? out_dtype=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, "
      "int[] normalized_shape, Tensor? weight, Tensor? bias, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
}

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_autograd);
  m.impl("layer_norm_bwd", &layer_norm_bwd_autograd);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_autocast_cuda);
}

}  // namespace fastlayers
