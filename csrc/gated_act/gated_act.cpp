// Gated activation op family: y = act(gate) * up in one pass (act: silu, gelu, gelu_tanh, relu).
//
//   gated_act_fwd(gate, up, activation) -> y
//   gated_act_bwd(grad_out, gate, up, activation, output_mask) -> (grad_gate, grad_up, product);
//       product is act(gate) * up recomputed in the same pass (bit for bit the forward's); an
//       output not asked for is an empty tensor.
//   gated_act_linear(gate, input, weight, activation) -> act(gate) * (input . weight^T), for
//       inference (no backward): on sm_90 GPUs the product in the up projection's GEMM epilogue.
//   gated_act_down(gate, up, weight, bias?, activation) -> linear(act(gate) * up, weight, bias):
//       a gated MLP's down projection of the product, for training: its node saves gate, up and
//       the weight, never the product (the activation memory native's down projection keeps,
//       [tokens, intermediate] a layer); backward recomputes the product in the pass that
//       computes the product's gradients, then the weight's gradient from it.
//
// gate and up may be views whose rows are strided (h.chunk(2, -1) of a [..., 2I] projection):
// the CUDA kernels read them in place. The CPU kernels compose ATen's own ops, so CPU results are
// native's bit for bit. Autograd is registered here in C++ (Autograd key): it saves gate and up,
// never act(gate), which backward recomputes.
#include "gated_act/gated_act.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.gated_act";
}  // namespace

Activation parse_gated_activation(c10::string_view activation) {
  if (activation == "silu") return Activation::kSiLU;
  if (activation == "gelu") return Activation::kGeluErf;
  if (activation == "gelu_tanh") return Activation::kGeluTanh;
  if (activation == "relu") return Activation::kReLU;
  TORCH_CHECK_VALUE(false, kOp, ": activation must be 'silu', 'gelu', 'gelu_tanh' or 'relu', got '",
                    std::string(activation), "'");
}

namespace {
void check_like_gate(const at::Tensor& t, const at::Tensor& gate, const char* arg) {
  check_same_device(t, gate, kOp, arg, "gate");
  TORCH_CHECK(t.scalar_type() == gate.scalar_type(), kOp, ": ", arg, " has dtype ",
              t.scalar_type(), " but gate has dtype ", gate.scalar_type(), "; they must match");
  TORCH_CHECK(t.sizes() == gate.sizes(), kOp, ": ", arg, " has shape ", shape_str(t.sizes()),
              " but gate has shape ", shape_str(gate.sizes()), "; they must match");
}
}  // namespace

void check_gated_act_args(const at::Tensor& gate, const at::Tensor& up,
                          const at::Tensor& grad_out) {
  check_input_dtype(gate, kOp, "gate");
  check_like_gate(up, gate, "up");
  if (grad_out.defined()) check_like_gate(grad_out, gate, "grad_out");
}

LinearDims check_gated_act_linear_args(const at::Tensor& gate, const at::Tensor& input,
                                       const at::Tensor& weight) {
  constexpr const char* op = "fastlayers.gated_act_linear";
  check_input_dtype(input, op, "input");
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [out_features, in_features], got ",
              shape_str(weight.sizes()));
  for (const at::Tensor* t : {&weight, &gate}) {
    const char* name = t == &weight ? "weight" : "gate";
    check_same_device(*t, input, op, name, "input");
    TORCH_CHECK(t->scalar_type() == input.scalar_type(), op, ": ", name, " has dtype ",
                t->scalar_type(), " but input has dtype ", input.scalar_type(),
                "; they must match");
  }
  const int64_t k = input.size(-1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, op, ": input of shape ", shape_str(input.sizes()),
              " does not match weight of shape ", shape_str(weight.sizes()),
              ": input's last dimension must be in_features = ", std::to_string(weight.size(1)));
  const auto shape = linear_act_out_shape(input, n);
  TORCH_CHECK(gate.sizes() == at::IntArrayRef(shape), op, ": gate has shape ",
              shape_str(gate.sizes()), " but input . weight^T has shape ", shape_str(shape),
              "; they must match");
  return {rows_of(input), k, n};
}

namespace {

// act(gate) by ATen's op, exactly what F.silu / F.gelu / torch.relu compute.
at::Tensor act_cpu(const at::Tensor& gate, Activation act) {
  switch (act) {
    case Activation::kSiLU:
      return at::silu(gate);
    case Activation::kGeluErf:
      return at::gelu(gate, "none");
    case Activation::kGeluTanh:
      return at::gelu(gate, "tanh");
    default:
      return at::relu(gate);
  }
}

at::Tensor gated_act_fwd_cpu(const at::Tensor& gate, const at::Tensor& up,
                             c10::string_view activation) {
  const Activation act = parse_gated_activation(activation);
  check_gated_act_args(gate, up);
  // contiguous: ATen's ops keep a permuted input's layout; the fake kernel and CUDA do not
  return at::mul(act_cpu(gate, act), up).contiguous();
}

// F.linear's GEMM (ATen's linear, what the Linear computes) and the product: native's bits.
at::Tensor gated_act_linear_cpu(const at::Tensor& gate, const at::Tensor& input,
                                const at::Tensor& weight, c10::string_view activation) {
  parse_gated_activation(activation);
  check_gated_act_linear_args(gate, input, weight);
  return gated_act_fwd_cpu(gate, at::linear(input, weight), activation);
}

// Native autograd of act(gate) * up, step for step: grad_up = dy * act(gate),
// grad_gate = act_backward(dy * up, gate) (ReLU's backward reads its output).
GatedActGrads gated_act_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& gate,
                                const at::Tensor& up, c10::string_view activation,
                                std::array<bool, 3> output_mask) {
  const Activation act = parse_gated_activation(activation);
  check_gated_act_args(gate, up, grad_out);
  at::Tensor dgate = at::empty({0}, gate.options()), dup = at::empty({0}, gate.options());
  at::Tensor product = output_mask[2] ? gated_act_fwd_cpu(gate, up, activation)
                                      : at::empty({0}, gate.options());
  if (output_mask[0]) {
    const at::Tensor dz = at::mul(grad_out, up);
    switch (act) {
      case Activation::kSiLU:
        dgate = at::silu_backward(dz, gate);
        break;
      case Activation::kGeluErf:
        dgate = at::gelu_backward(dz, gate, "none");
        break;
      case Activation::kGeluTanh:
        dgate = at::gelu_backward(dz, gate, "tanh");
        break;
      default:
        dgate = at::threshold_backward(dz, at::relu(gate), 0);
    }
    dgate = dgate.contiguous();
  }
  if (output_mask[1]) dup = at::mul(grad_out, act_cpu(gate, act)).contiguous();
  return {dgate, dup, product};
}

// ---------------------------------------------------------------------------------------------
// Autograd (C++, a FusedNode): saves gate and up; backward calls gated_act_bwd.

using FwdSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view);
using BwdSig = GatedActGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             c10::string_view, std::array<bool, 3>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = find_op<FwdSig>("fastlayers::gated_act_fwd");
  return op;
}

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = find_op<BwdSig>("fastlayers::gated_act_bwd");
  return op;
}

class GatedActBackward : public FusedNode {
 public:
  SavedVariable gate, up;
  std::string activation;

  std::string name() const override { return "fastlayers::GatedActBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "the native act(gate) * up");
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor(), at::Tensor()};
    const std::array<bool, 3> mask = {should_compute_output(0), should_compute_output(1), false};
    auto [dgate, dup, unused] = bwd_op().call(dy, unpack(gate), unpack(up), activation, mask);
    return {mask[0] ? dgate : at::Tensor(), mask[1] ? dup : at::Tensor()};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&gate, &up}; }
};

at::Tensor gated_act_fwd_autograd(const at::Tensor& gate, const at::Tensor& up,
                                  c10::string_view activation) {
  if (!records_grad(gate, up)) {
    // Nothing to record: skip the autograd node and its bookkeeping (inference host time).
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(gate, up, activation);
  }
  NodePtr node_ptr = make_node<GatedActBackward>();
  auto* node = static_cast<GatedActBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(gate, up));
  at::Tensor y = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(gate, up, activation);
  }();
  torch::autograd::set_history(y, node_ptr);
  node->gate = SavedVariable(gate, false);
  node->up = SavedVariable(up, false);
  node->activation = std::string(activation);
  return y;
}

// gated_act_bwd is not differentiable (the node refuses create_graph); this kernel only steps
// below autograd, sparing the boxed default fallback on every backward.
GatedActGrads gated_act_bwd_autograd(const at::Tensor& grad_out, const at::Tensor& gate,
                                     const at::Tensor& up, c10::string_view activation,
                                     std::array<bool, 3> output_mask) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return bwd_op().call(grad_out, gate, up, activation, output_mask);
}

using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             c10::string_view);

const c10::TypedOperatorHandle<LinearSig>& linear_op() {
  static const auto op = find_op<LinearSig>("fastlayers::gated_act_linear");
  return op;
}

// No backward: the epilogue keeps neither up nor act(gate). Calls that record gradients are
// refused (the patcher's gated MLP calls it only where none is recorded).
at::Tensor gated_act_linear_autograd(const at::Tensor& gate, const at::Tensor& input,
                                     const at::Tensor& weight, c10::string_view activation) {
  TORCH_CHECK(!records_grad(gate, input, weight),
              "fastlayers.gated_act_linear is for inference (it has no backward): gate, input "
              "and weight must not require grad while grad mode is on; to train, call gated_act "
              "on the Linear's output");
  at::AutoDispatchBelowADInplaceOrView guard;
  return linear_op().call(gate, input, weight, activation);
}

// ---------------------------------------------------------------------------------------------
// gated_act_down: linear(act(gate) * up, weight, bias), saving gate, up and the weight only.

constexpr const char* kDownOp = "fastlayers.gated_act_down";

using DownSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, c10::string_view);

const c10::TypedOperatorHandle<DownSig>& down_op() {
  static const auto op = find_op<DownSig>("fastlayers::gated_act_down");
  return op;
}

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// weight [out, intermediate] and bias [out] against gate (which gated_act_fwd checks with up):
// same device and dtype as gate (as F.linear requires of the product; under autocast the
// autocast kernel has cast them), errors naming the argument.
void check_gated_act_down_args(const at::Tensor& gate, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(gate.dim() >= 1, kDownOp, ": gate must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2, kDownOp,
              ": weight must be 2-D [out_features, in_features], got ", shape_str(weight.sizes()));
  TORCH_CHECK(weight.size(1) == gate.size(-1), kDownOp, ": weight of shape ",
              shape_str(weight.sizes()), " does not take the product's ",
              std::to_string(gate.size(-1)), " features (gate ", shape_str(gate.sizes()), ")");
  for (const at::Tensor* t : {&weight, defined(bias) ? &*bias : nullptr}) {
    if (t == nullptr) continue;
    const char* name = t == &weight ? "weight" : "bias";
    check_same_device(*t, gate, kDownOp, name, "gate");
    TORCH_CHECK(t->scalar_type() == gate.scalar_type(), kDownOp, ": ", name, " has dtype ",
                t->scalar_type(), " but gate has dtype ", gate.scalar_type(),
                "; they must match, as for torch.nn.functional.linear (under torch.autocast "
                "float32 parameters are cast for you)");
  }
  if (defined(bias)) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), kDownOp,
                ": bias must have shape [", std::to_string(weight.size(0)), "], got ",
                shape_str(bias->sizes()));
  }
}

// Below autograd (CPU and CUDA alike): the product by gated_act_fwd, then at::linear, the call
// F.linear makes, so the output is native's down projection's bit for bit.
at::Tensor gated_act_down_impl(const at::Tensor& gate, const at::Tensor& up,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               c10::string_view activation) {
  check_gated_act_down_args(gate, weight, bias);
  return at::linear(fwd_op().call(gate, up, activation), weight, bias);
}

// Edges: gate, up, weight, bias (absent: an empty edge). The gradients are native's, from the
// same calls native's autograd makes: the product's gradient dy . W (mm of the rows), act * up's
// backward on it, the weight's dy^T . product (mm, the layout mm's backward picks for a
// transposed weight), the bias's column sums of dy.
class GatedActDownBackward : public FusedNode {
 public:
  SavedVariable gate, up, weight;
  std::string activation;
  bool has_bias = false;

  std::string name() const override { return "fastlayers::GatedActDownBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kDownOp, "the native down projection of act(gate) * up");
    variable_list out(4);
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    const at::Tensor g = unpack(gate), u = unpack(up), w = unpack(weight);
    const bool want_dg = should_compute_output(0), want_du = should_compute_output(1);
    const bool want_dw = should_compute_output(2);
    const bool want_db = has_bias && should_compute_output(3);
    const int64_t m = rows_of(dy);
    const at::Tensor dy2 = dy.reshape({m, dy.size(-1)});
    at::Tensor product;
    if (want_dg || want_du) {
      // the product's gradient, then in one pass its factors' gradients and the product again
      const at::Tensor dproduct = at::mm(dy2, w).view(g.sizes());
      auto [dg, du, p] =
          bwd_op().call(dproduct, g, u, activation, {want_dg, want_du, want_dw});
      if (want_dg) out[0] = dg;
      if (want_du) out[1] = du;
      product = p;
    } else if (want_dw) {
      product = fwd_op().call(g, u, activation);
    }
    if (want_dw) out[2] = at::mm(dy2.t(), product.reshape({m, w.size(1)}));
    if (want_db) out[3] = dy2.sum(0);
    return out;
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&gate, &up, &weight}; }
};

at::Tensor gated_act_down_autograd(const at::Tensor& gate, const at::Tensor& up,
                                   const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias,
                                   c10::string_view activation) {
  if (!records_grad(gate, up, weight, bias)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return down_op().call(gate, up, weight, bias, activation);
  }
  NodePtr node_ptr = make_node<GatedActDownBackward>();
  auto* node = static_cast<GatedActDownBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(gate, up, weight, bias));
  at::Tensor y = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return down_op().call(gate, up, weight, bias, activation);
  }();
  torch::autograd::set_history(y, node_ptr);
  node->gate = SavedVariable(gate, false);
  node->up = SavedVariable(up, false);
  node->weight = SavedVariable(weight, false);
  node->activation = std::string(activation);
  node->has_bias = defined(bias);
  return y;
}

// Autocast: the down projection runs in the autocast dtype, as nn.Linear's does (the weight's
// cast cached for the region, as F.linear's is; gate and up, a Linear's outputs there, are in
// that dtype already). Their product is act * up's, which autocast leaves in its inputs' dtype.
template <c10::DeviceType kDevice, c10::DispatchKey kKey>
at::Tensor gated_act_down_autocast(const at::Tensor& gate, const at::Tensor& up,
                                   const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias,
                                   c10::string_view activation) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kKey);
  const at::ScalarType to = at::autocast::get_autocast_dtype(kDevice);
  std::optional<at::Tensor> b = bias;
  if (defined(b)) b = at::autocast::cached_cast(to, *b, kDevice);
  return down_op().call(at::autocast::cached_cast(to, gate, kDevice),
                        at::autocast::cached_cast(to, up, kDevice),
                        at::autocast::cached_cast(to, weight, kDevice), b, activation);
}

}  // namespace

at::Tensor gated_act_down_eager(const at::Tensor& gate, const at::Tensor& up,
                                const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const std::string& activation) {
  return down_op().call(gate, up, weight, bias, activation);
}

at::Tensor gated_act_linear_eager(const at::Tensor& gate, const at::Tensor& input,
                                  const at::Tensor& weight, const std::string& activation) {
  return linear_op().call(gate, input, weight, activation);
}

at::Tensor gated_act_eager(const at::Tensor& gate, const at::Tensor& up,
                           const std::string& activation) {
  return fwd_op().call(gate, up, activation);
}

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def("gated_act_fwd(Tensor gate, Tensor up, str activation) -> Tensor");
  m.def(
      "gated_act_bwd(Tensor grad_out, Tensor gate, Tensor up, str activation, "
      "bool[3] output_mask) -> (Tensor grad_gate, Tensor grad_up, Tensor product)");
  m.def("gated_act_linear(Tensor gate, Tensor input, Tensor weight, str activation) -> Tensor");
  m.def(
      "gated_act_down(Tensor gate, Tensor up, Tensor weight, Tensor? bias, str activation) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("gated_act_fwd", &gated_act_fwd_cpu);
  m.impl("gated_act_bwd", &gated_act_bwd_cpu);
  m.impl("gated_act_linear", &gated_act_linear_cpu);
  m.impl("gated_act_down", &gated_act_down_impl);
}

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) { m.impl("gated_act_down", &gated_act_down_impl); }

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("gated_act_fwd", &gated_act_fwd_autograd);
  m.impl("gated_act_bwd", &gated_act_bwd_autograd);
  m.impl("gated_act_linear", &gated_act_linear_autograd);
  m.impl("gated_act_down", &gated_act_down_autograd);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCUDA, m) {
  m.impl("gated_act_down",
         &gated_act_down_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCPU, m) {
  m.impl("gated_act_down",
         &gated_act_down_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

}  // namespace fastlayers
