// RMSNorm op family: schemas, argument checks, the composite (CPU) kernels, autograd, autocast.
//
//   rms_norm_fwd(input, normalized_shape, weight?, eps?, form, out_dtype?) -> (y, rstd)
//   rms_norm_bwd(grad_out, input, rstd, normalized_shape, weight?, form, output_mask)
//       -> (grad_input, grad_weight); an output not asked for is an empty tensor.
//
// rms_norm.h says what each form computes. Autograd is registered here in C++ (Autograd key).
#include "rms_norm/rms_norm.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.rms_norm";

bool is_half(at::ScalarType st) { return st == at::kHalf || st == at::kBFloat16; }

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The normalized dimensions, last first (as torch's rms_norm lists them).
std::vector<int64_t> norm_dims(const at::Tensor& input, at::IntArrayRef normalized_shape) {
  std::vector<int64_t> dims;
  for (size_t i = 0; i < normalized_shape.size(); ++i)
    dims.push_back(input.dim() - 1 - static_cast<int64_t>(i));
  return dims;
}

at::IntArrayRef stat_shape(const at::Tensor& input, at::IntArrayRef normalized_shape) {
  return input.sizes().slice(0, input.dim() - normalized_shape.size());
}

// rstd [leading...] viewed as [leading..., 1, ..., 1] to broadcast over the normalized dims.
at::Tensor rstd_keepdim(const at::Tensor& rstd, const at::Tensor& input,
                        at::IntArrayRef normalized_shape) {
  std::vector<int64_t> shape(rstd.sizes().begin(), rstd.sizes().end());
  shape.insert(shape.end(), normalized_shape.size(), 1);
  return rstd.reshape(shape);
}
}  // namespace

RmsNormForm rms_norm_form(int64_t form) {
  TORCH_CHECK(form >= 0 && form <= static_cast<int64_t>(RmsNormForm::kFloat32), kOp,
              ": form must be 0 (torch), 1 (cast first), 2 (T5), 3 (Gemma) or 4 (float32), got ",
              std::to_string(form));
  return static_cast<RmsNormForm>(form);
}

double rms_norm_eps(std::optional<double> eps, at::ScalarType input) {
  if (eps.has_value()) return *eps;
  return input == at::kDouble ? std::numeric_limits<double>::epsilon()
                              : static_cast<double>(std::numeric_limits<float>::epsilon());
}

std::optional<at::ScalarType> rms_norm_mid_dtype(RmsNormForm form, at::ScalarType input,
                                                 const std::optional<at::Tensor>& weight) {
  if (form == RmsNormForm::kCastFirst && input != at::kFloat) return input;
  if (form == RmsNormForm::kT5 && has(weight) && is_half(weight->scalar_type()))
    return weight->scalar_type();
  return std::nullopt;
}

at::ScalarType rms_norm_out_dtype(RmsNormForm form, at::ScalarType input,
                                  const std::optional<at::Tensor>& weight,
                                  std::optional<at::ScalarType> out_dtype) {
  if (out_dtype.has_value()) return *out_dtype;
  const bool w = has(weight);
  switch (form) {
    case RmsNormForm::kCastFirst:  // weight * xhat.to(input dtype)
      return w ? c10::promoteTypes(input, weight->scalar_type()) : input;
    case RmsNormForm::kT5: {  // xhat (float32, or float64 for float64 input) times weight
      if (!w) return c10::promoteTypes(input, at::kFloat);
      if (is_half(weight->scalar_type())) return weight->scalar_type();
      return c10::promoteTypes(c10::promoteTypes(input, at::kFloat), weight->scalar_type());
    }
    default:  // cast back to the input's dtype
      return input;
  }
}

std::array<int64_t, 2> check_rms_norm_args(const at::Tensor& input,
                                           at::IntArrayRef normalized_shape,
                                           const std::optional<at::Tensor>& weight, int64_t form,
                                           std::optional<at::ScalarType> out_dtype) {
  check_input_dtype(input, kOp, "input");
  const RmsNormForm f = rms_norm_form(form);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1, kOp, ": normalized_shape must have at least one dimension");
  TORCH_CHECK(input.dim() >= k && input.sizes().slice(input.dim() - k) == normalized_shape, kOp,
              ": input of shape ", shape_str(input.sizes()), " does not end with normalized_shape ",
              shape_str(normalized_shape));
  if (has(weight)) {
    check_same_device(*weight, input, kOp, "weight", "input");
    check_input_dtype(*weight, kOp, "weight");
    TORCH_CHECK(weight->sizes() == normalized_shape, kOp, ": weight has shape ",
                shape_str(weight->sizes()), " but normalized_shape is ",
                shape_str(normalized_shape));
  } else {
    TORCH_CHECK(f == RmsNormForm::kTorch, kOp, ": form ", std::to_string(form),
                " needs a weight (only form 0, torch.nn.RMSNorm's, takes none)");
  }
  if (out_dtype.has_value()) {
    TORCH_CHECK(f == RmsNormForm::kTorch && *out_dtype == at::kFloat, kOp,
                ": out_dtype may only be float32, with form 0 (autocast's)");
  }
  int64_t cols = 1;
  for (int64_t s : normalized_shape) cols *= s;
  TORCH_CHECK(cols <= std::numeric_limits<int32_t>::max(), kOp,
              ": normalized_shape has more than 2^31-1 elements");
  return {cols == 0 ? 0 : input.numel() / cols, cols};
}

RmsNormOutputs rms_norm_fwd_composite(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight,
                                      std::optional<double> eps, int64_t form,
                                      std::optional<at::ScalarType> out_dtype) {
  check_rms_norm_args(input, normalized_shape, weight, form, out_dtype);
  const RmsNormForm f = rms_norm_form(form);
  const std::vector<int64_t> dims = norm_dims(input, normalized_shape);
  const at::ScalarType in = input.scalar_type();
  const double e = rms_norm_eps(eps, in);
  // The statistics as each model writes them: x.pow(2).mean(dims, keepdim) + eps, rsqrt.
  const auto rsqrt_of = [&](const at::Tensor& x) {
    return at::rsqrt(at::pow(x, 2).mean(dims, /*keepdim=*/true).add(e));
  };
  at::Tensor y, rstd;
  switch (f) {
    case RmsNormForm::kTorch:
    case RmsNormForm::kFloat32: {  // torch's rms_norm; OLMo2 (always in float32)
      const at::ScalarType acc =
          in == at::kDouble && f == RmsNormForm::kTorch ? at::kDouble : at::kFloat;
      const at::Tensor up = input.to(acc);
      rstd = rsqrt_of(up);
      y = up.mul(rstd);
      if (has(weight)) y = y.mul(*weight);
      y = y.to(rms_norm_out_dtype(f, in, weight, out_dtype));
      break;
    }
    case RmsNormForm::kCastFirst: {  // LLaMA: weight * (x32 * rstd).to(input dtype)
      const at::Tensor x32 = input.to(at::kFloat);
      rstd = rsqrt_of(x32);
      y = weight->mul(x32.mul(rstd).to(in));
      break;
    }
    case RmsNormForm::kT5: {  // weight * (x * rstd), cast to a half weight's dtype first
      rstd = rsqrt_of(input.to(at::kFloat));
      at::Tensor h = input.mul(rstd);
      if (is_half(weight->scalar_type())) h = h.to(weight->scalar_type());
      y = weight->mul(h);
      break;
    }
    case RmsNormForm::kGemma: {  // (x32 * rstd) * (1 + weight.float()), cast to input dtype
      const at::Tensor x32 = input.to(at::kFloat);
      rstd = rsqrt_of(x32);
      y = x32.mul(rstd).mul(weight->to(at::kFloat).add(1.0)).to(in);
      break;
    }
  }
  // rstd in float32 (float64 where computed so), shaped [leading...]
  const at::ScalarType stat = rstd.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {y, rstd.to(stat).reshape(stat_shape(input, normalized_shape)).contiguous()};
}

RmsNormOutputs rms_norm_bwd_composite(const at::Tensor& grad_out, const at::Tensor& input,
                                      const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight, int64_t form,
                                      std::array<bool, 2> output_mask) {
  const RmsNormForm f = rms_norm_form(form);
  const std::vector<int64_t> dims = norm_dims(input, normalized_shape);
  const at::ScalarType acc = rstd.scalar_type();
  const at::Tensor r = rstd_keepdim(rstd, input, normalized_shape).to(acc);
  const at::Tensor xhat = input.to(acc).mul(r);
  const at::Tensor dy = grad_out.to(acc);
  at::Tensor dx = at::empty({0}, input.options()), dw = at::empty({0}, input.options());
  const bool want_dw = output_mask[1] && has(weight);
  if (output_mask[0]) {
    // y = mid(xhat) * w': dL/dxhat = dy * w' (the cast passes the gradient through), and
    // dx = rstd * (g - xhat * mean(g * xhat)).
    at::Tensor g = dy;
    if (has(weight)) {
      at::Tensor w = weight->to(acc);
      if (f == RmsNormForm::kGemma) w = w.add(1.0);
      g = dy.mul(w);
    }
    const at::Tensor c = g.mul(xhat).mean(dims, /*keepdim=*/true);
    dx = r.mul(g.sub(xhat.mul(c))).to(input.scalar_type());
  }
  if (want_dw) {
    const auto mid = rms_norm_mid_dtype(f, input.scalar_type(), weight);
    const at::Tensor xm = mid.has_value() ? xhat.to(*mid).to(acc) : xhat;
    std::vector<int64_t> lead;
    for (int64_t d = 0; d < input.dim() - static_cast<int64_t>(normalized_shape.size()); ++d)
      lead.push_back(d);
    at::Tensor prod = dy.mul(xm);
    dw = (lead.empty() ? prod : prod.sum(lead)).to(weight->scalar_type());
  }
  return {dx, dw};
}

void check_rms_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& input,
                                  const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                  const std::optional<at::Tensor>& weight, int64_t form) {
  const auto rc = check_rms_norm_args(input, normalized_shape, weight, form, std::nullopt);
  check_input_dtype(grad_out, kOp, "grad_out");
  check_same_device(grad_out, input, kOp, "grad_out", "input");
  check_same_device(rstd, input, kOp, "rstd", "input");
  TORCH_CHECK(grad_out.sizes() == input.sizes(), kOp, ": grad_out has shape ",
              shape_str(grad_out.sizes()), " but input has shape ", shape_str(input.sizes()));
  TORCH_CHECK((rstd.scalar_type() == at::kFloat || rstd.scalar_type() == at::kDouble) &&
                  rstd.numel() == rc[0],
              kOp, ": rstd must be a float32 or float64 tensor of ", std::to_string(rc[0]),
              " elements (one per row)");
}

namespace {

RmsNormOutputs rms_norm_fwd_cpu(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                const std::optional<at::Tensor>& weight,
                                std::optional<double> eps, int64_t form,
                                std::optional<at::ScalarType> out_dtype) {
  return rms_norm_fwd_composite(input, normalized_shape, weight, eps, form, out_dtype);
}

RmsNormOutputs rms_norm_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& input,
                                const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                const std::optional<at::Tensor>& weight, int64_t form,
                                std::array<bool, 2> output_mask) {
  check_rms_norm_backward_args(grad_out, input, rstd, normalized_shape, weight, form);
  return rms_norm_bwd_composite(grad_out, input, rstd, normalized_shape, weight, form,
                                output_mask);
}

using FwdSig = RmsNormOutputs(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                              std::optional<double>, int64_t, std::optional<at::ScalarType>);
using BwdSig = RmsNormOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              at::IntArrayRef, const std::optional<at::Tensor>&, int64_t,
                              std::array<bool, 2>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = find_op<FwdSig>("fastlayers::rms_norm_fwd");
  return op;
}

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = find_op<BwdSig>("fastlayers::rms_norm_bwd");
  return op;
}

// Backward of rms_norm_fwd: saves input, weight, rstd; calls rms_norm_bwd.
class RmsNormBackward : public FusedNode {
 public:
  SavedVariable input, weight, rstd;
  int64_t form = 0;

  std::string name() const override { return "fastlayers::RmsNormBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "the model's own RMSNorm");
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor x = unpack(input), r = unpack(rstd);
    const std::optional<at::Tensor> w = unpack_optional(weight);
    const at::IntArrayRef normalized_shape = x.sizes().slice(r.dim());
    const std::array<bool, 2> mask = {should_compute_output(0),
                                      w.has_value() && should_compute_output(1)};
    auto [dx, dw] = bwd_op().call(dy, x, r, normalized_shape, w, form, mask);
    return {mask[0] ? dx : at::Tensor(), mask[1] ? dw : at::Tensor()};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&input, &weight, &rstd}; }
};

RmsNormOutputs rms_norm_fwd_autograd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight,
                                     std::optional<double> eps, int64_t form,
                                     std::optional<at::ScalarType> out_dtype) {
  if (!records_grad(input, weight)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(input, normalized_shape, weight, eps, form, out_dtype);
  }
  NodePtr node_ptr = make_node<RmsNormBackward>();
  auto* node = static_cast<RmsNormBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight));
  RmsNormOutputs out = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(input, normalized_shape, weight, eps, form, out_dtype);
  }();
  const auto& [y, rstd] = out;
  torch::autograd::set_history(y, node_ptr);  // rstd gets no gradient
  node->input = SavedVariable(input, false);
  node->weight = SavedVariable(weight, false);
  node->rstd = SavedVariable(rstd, false);
  node->form = form;
  return out;
}

RmsNormOutputs rms_norm_bwd_autograd(const at::Tensor& grad_out, const at::Tensor& input,
                                     const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                     const std::optional<at::Tensor>& weight, int64_t form,
                                     std::array<bool, 2> output_mask) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return bwd_op().call(grad_out, input, rstd, normalized_shape, weight, form, output_mask);
}

// Whether this torch's CUDA autocast casts rms_norm to float32 (its float32 list holds rms_norm
// in torch 2.13; torch 2.11's autocast left it alone): asked of the dispatcher once.
bool native_autocasts_rms_norm() {
  static const bool listed = [] {
    const auto op = c10::Dispatcher::singleton().findSchema({"aten::rms_norm", ""});
    return op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA);
  }();
  return listed;
}

// Where CUDA autocast puts rms_norm on its float32 list, torch.nn.RMSNorm returns float32 under
// it. Form 0 (nn.RMSNorm's) then matches that output dtype and numerics (a half -> float32 cast
// is exact) and reads the half input directly. The models' own forms call no autocast-listed
// op on a half value (they cast to float32 themselves), so autocast changes nothing for them.
RmsNormOutputs rms_norm_fwd_autocast_cuda(const at::Tensor& input,
                                          at::IntArrayRef normalized_shape,
                                          const std::optional<at::Tensor>& weight,
                                          std::optional<double> eps, int64_t form,
                                          std::optional<at::ScalarType> out_dtype) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  if (form != static_cast<int64_t>(RmsNormForm::kTorch) || !input.is_cuda() ||
      !is_half(input.scalar_type()) || !native_autocasts_rms_norm()) {
    return fwd_op().call(input, normalized_shape, weight, eps, form, out_dtype);
  }
  std::optional<at::Tensor> w = weight;
  if (has(w) && w->scalar_type() != at::kFloat && w->is_floating_point()) w = w->to(at::kFloat);
  return fwd_op().call(input, normalized_shape, w, eps, form, at::kFloat);
}

}  // namespace

at::Tensor rms_norm_eager(const at::Tensor& input, at::IntArrayRef normalized_shape,
                          const std::optional<at::Tensor>& weight, std::optional<double> eps,
                          int64_t form) {
  return std::get<0>(fwd_op().call(input, normalized_shape, weight, eps, form, std::nullopt));
}

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def(
      "rms_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, float? eps, int form, "
      "ScalarType? out_dtype=None) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_bwd(Tensor grad_out, Tensor input, Tensor rstd, int[] normalized_shape, "
      "Tensor? weight, int form, bool[2] output_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cpu);
}

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_autograd);
  m.impl("rms_norm_bwd", &rms_norm_bwd_autograd);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_autocast_cuda);
}

}  // namespace fastlayers
