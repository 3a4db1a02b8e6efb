// Residual add + RMSNorm: schemas, argument checks, the composite (CPU) kernels, autograd.
//
//   add_rms_norm_fwd(x, residual, normalized_shape, weight?, eps?, form) -> (y, sum, rstd)
//   add_rms_norm_bwd(grad_y, grad_sum?, sum, rstd, normalized_shape, weight?, form,
//                    output_mask[3]) -> (grad_x, grad_residual, grad_weight)
//
// A decoder layer's `h = residual + x; y = norm(h)` with h kept as the next residual: on CUDA
// x and residual are read once and y and h written once (the LayerNorm row kernels with the
// dropout + add source, RMS = true). Nothing is written in place: h is a new tensor.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"
#include "rms_norm/rms_norm.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.add_rms_norm";

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }
}  // namespace

std::array<int64_t, 2> check_add_rms_norm_args(const at::Tensor& x, const at::Tensor& residual,
                                               at::IntArrayRef normalized_shape,
                                               const std::optional<at::Tensor>& weight,
                                               int64_t form) {
  check_input_dtype(x, kOp, "x");
  check_input_dtype(residual, kOp, "residual");
  check_same_device(residual, x, kOp, "residual", "x");
  TORCH_CHECK(residual.sizes() == x.sizes(), kOp, ": residual has shape ",
              shape_str(residual.sizes()), " but x has shape ", shape_str(x.sizes()));
  return check_rms_norm_args(x, normalized_shape, weight, form, std::nullopt);
}

AddRmsNormOutputs add_rms_norm_fwd_composite(const at::Tensor& x, const at::Tensor& residual,
                                             at::IntArrayRef normalized_shape,
                                             const std::optional<at::Tensor>& weight,
                                             std::optional<double> eps, int64_t form) {
  check_add_rms_norm_args(x, residual, normalized_shape, weight, form);
  const at::Tensor sum = residual.add(x);  // the models' `residual + hidden_states`
  auto [y, rstd] = rms_norm_fwd_composite(sum, normalized_shape, weight, eps, form, std::nullopt);
  return {y, sum, rstd};
}

AddRmsNormOutputs add_rms_norm_bwd_composite(const at::Tensor& grad_y,
                                             const std::optional<at::Tensor>& grad_sum,
                                             const at::Tensor& sum, const at::Tensor& rstd,
                                             at::IntArrayRef normalized_shape,
                                             const std::optional<at::Tensor>& weight,
                                             int64_t form, std::array<bool, 3> output_mask) {
  const bool want_ds = output_mask[0] || output_mask[1];
  auto [dn, dw] = rms_norm_bwd_composite(grad_y, sum, rstd, normalized_shape, weight, form,
                                         {want_ds, output_mask[2]});
  at::Tensor ds = at::empty({0}, sum.options());
  if (want_ds) ds = has(grad_sum) ? dn.add(*grad_sum) : dn;
  return {output_mask[0] ? ds : at::empty({0}, sum.options()),
          output_mask[1] ? ds : at::empty({0}, sum.options()), dw};
}

void check_add_rms_norm_backward_args(const at::Tensor& grad_y,
                                      const std::optional<at::Tensor>& grad_sum,
                                      const at::Tensor& sum, const at::Tensor& rstd,
                                      at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight, int64_t form) {
  check_rms_norm_backward_args(grad_y, sum, rstd, normalized_shape, weight, form);
  if (has(grad_sum)) {
    check_same_device(*grad_sum, sum, kOp, "grad_sum", "sum");
    TORCH_CHECK(grad_sum->sizes() == sum.sizes(), kOp, ": grad_sum has shape ",
                shape_str(grad_sum->sizes()), " but sum has shape ", shape_str(sum.sizes()));
  }
}

namespace {

AddRmsNormOutputs add_rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& residual,
                                       at::IntArrayRef normalized_shape,
                                       const std::optional<at::Tensor>& weight,
                                       std::optional<double> eps, int64_t form) {
  return add_rms_norm_fwd_composite(x, residual, normalized_shape, weight, eps, form);
}

AddRmsNormOutputs add_rms_norm_bwd_cpu(const at::Tensor& grad_y,
                                       const std::optional<at::Tensor>& grad_sum,
                                       const at::Tensor& sum, const at::Tensor& rstd,
                                       at::IntArrayRef normalized_shape,
                                       const std::optional<at::Tensor>& weight, int64_t form,
                                       std::array<bool, 3> output_mask) {
  check_add_rms_norm_backward_args(grad_y, grad_sum, sum, rstd, normalized_shape, weight, form);
  return add_rms_norm_bwd_composite(grad_y, grad_sum, sum, rstd, normalized_shape, weight, form,
                                    output_mask);
}

using FwdSig = AddRmsNormOutputs(const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                 const std::optional<at::Tensor>&, std::optional<double>, int64_t);
using BwdSig = AddRmsNormOutputs(const at::Tensor&, const std::optional<at::Tensor>&,
                                 const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                 const std::optional<at::Tensor>&, int64_t, std::array<bool, 3>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = find_op<FwdSig>("fastlayers::add_rms_norm_fwd");
  return op;
}

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = find_op<BwdSig>("fastlayers::add_rms_norm_bwd");
  return op;
}

// Backward of add_rms_norm_fwd: saves the sum (an output), rstd and weight.
class AddRmsNormBackward : public FusedNode {
 public:
  SavedVariable sum, weight, rstd;
  int64_t form = 0;

  std::string name() const override { return "fastlayers::AddRmsNormBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "the model's own add and RMSNorm");
    const at::Tensor& dy = grads[0];
    const at::Tensor& dsum = grads[1];
    if (!dy.defined() && !dsum.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor s = unpack(sum), r = unpack(rstd);
    const std::optional<at::Tensor> w = unpack_optional(weight);
    const std::array<bool, 3> mask = {should_compute_output(0), should_compute_output(1),
                                      w.has_value() && should_compute_output(2) && dy.defined()};
    if (!dy.defined()) return {mask[0] ? dsum : at::Tensor(), mask[1] ? dsum : at::Tensor(),
                               at::Tensor()};
    const at::IntArrayRef normalized_shape = s.sizes().slice(r.dim());
    const std::optional<at::Tensor> gs = dsum.defined() ? std::optional(dsum) : std::nullopt;
    auto [gx, gr, dw] = bwd_op().call(dy, gs, s, r, normalized_shape, w, form, mask);
    return {mask[0] ? gx : at::Tensor(), mask[1] ? gr : at::Tensor(),
            mask[2] ? dw : at::Tensor()};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&sum, &weight, &rstd}; }
};

AddRmsNormOutputs add_rms_norm_fwd_autograd(const at::Tensor& x, const at::Tensor& residual,
                                            at::IntArrayRef normalized_shape,
                                            const std::optional<at::Tensor>& weight,
                                            std::optional<double> eps, int64_t form) {
  if (!records_grad(x, residual, weight)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(x, residual, normalized_shape, weight, eps, form);
  }
  NodePtr node_ptr = make_node<AddRmsNormBackward>();
  auto* node = static_cast<AddRmsNormBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight));
  AddRmsNormOutputs out = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(x, residual, normalized_shape, weight, eps, form);
  }();
  const auto& [y, sum, rstd] = out;
  torch::autograd::set_history(y, node_ptr);    // output 0
  torch::autograd::set_history(sum, node_ptr);  // output 1; rstd gets no gradient
  node->sum = SavedVariable(sum, true);
  node->weight = SavedVariable(weight, false);
  node->rstd = SavedVariable(rstd, false);
  node->form = form;
  return out;
}

AddRmsNormOutputs add_rms_norm_bwd_autograd(const at::Tensor& grad_y,
                                            const std::optional<at::Tensor>& grad_sum,
                                            const at::Tensor& sum, const at::Tensor& rstd,
                                            at::IntArrayRef normalized_shape,
                                            const std::optional<at::Tensor>& weight,
                                            int64_t form, std::array<bool, 3> output_mask) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return bwd_op().call(grad_y, grad_sum, sum, rstd, normalized_shape, weight, form, output_mask);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm_eager(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      at::IntArrayRef normalized_shape,
                                                      const std::optional<at::Tensor>& weight,
                                                      std::optional<double> eps, int64_t form) {
  auto [y, sum, rstd] = fwd_op().call(x, residual, normalized_shape, weight, eps, form);
  return {y, sum};
}

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def(
      "add_rms_norm_fwd(Tensor x, Tensor residual, int[] normalized_shape, Tensor? weight, "
      "float? eps, int form) -> (Tensor, Tensor, Tensor)");
  m.def(
      "add_rms_norm_bwd(Tensor grad_y, Tensor? grad_sum, Tensor sum, Tensor rstd, "
      "int[] normalized_shape, Tensor? weight, int form, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd_cpu);
  m.impl("add_rms_norm_bwd", &add_rms_norm_bwd_cpu);
}

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd_autograd);
  m.impl("add_rms_norm_bwd", &add_rms_norm_bwd_autograd);
}

}  // namespace fastlayers
