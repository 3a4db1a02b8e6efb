// The MLP op of the Linear + activation family: Linear1 -> activation -> Linear2 as one op
// (FusedLinearAct's forward, then Linear2), whose backward fuses the activation's derivative
// into the GEMM that produces Linear2's input gradient (linear_act_dgrad: on sm_90 one CUTLASS
// GEMM whose epilogue reads the saved pre-activation and writes dz, the first bias's gradient
// then dz's column sum; elsewhere cuBLAS and the elementwise backward pass).
//
//   linear_act_linear(input, weight1, bias1?, weight2, bias2?, activation, weight1_transposed,
//                     weight2_transposed) -> y = linear2(act(linear1(input)))
//
// Autograd saves what the two native layers save (input, the activation's output, which is
// Linear2's input, and z for GELU) and registers in C++, as linear_act_fwd's. Where the sm90
// forward kernel runs (linear_act_keeps_derivative), GELU keeps gelu'(z) instead of z: its
// epilogue computes it beside gelu(z) for one more exp2, and the backward GEMM's epilogue then
// only multiplies (dz = gelu'(z) * (dy . W2)) instead of evaluating gelu' there. The kept
// derivative is rounded to the dtype as z would be; native rounds dy . W2 to it before the
// multiply, a rounding of the same size (tests/test_linear_act_linear.py bounds the gradients).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"
#include "linear_act/linear_act.h"

#ifndef FASTLAYERS_WITH_CUDA
#define FASTLAYERS_WITH_CUDA 0
#endif

namespace fastlayers {
namespace {

constexpr const char* kOp = "fastlayers.linear_act_linear";

using LinearActLinearSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, c10::string_view, bool,
                                      bool);
using FwdSig = LinearActOutputs(const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, c10::string_view, bool, bool,
                                 bool);
using DgradSig = DgradOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              c10::string_view, bool, bool, bool, bool);


const c10::TypedOperatorHandle<LinearActLinearSig>& mlp_op() {
  static const auto op = find_op<LinearActLinearSig>("fastlayers::linear_act_linear");
  return op;
}
const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = find_op<FwdSig>("fastlayers::linear_act_fwd");
  return op;
}
const c10::TypedOperatorHandle<DgradSig>& dgrad_op() {
  static const auto op = find_op<DgradSig>("fastlayers::linear_act_dgrad");
  return op;
}
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)>& column_sums_op() {
  static const auto op = find_op<at::Tensor(const at::Tensor&)>("fastlayers::column_sums");
  return op;
}

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Linear2 as nn.Linear (or HF Conv1D, weight stored [in, out]) computes it.
at::Tensor linear2(const at::Tensor& h, const at::Tensor& weight2,
                   const std::optional<at::Tensor>& bias2, bool weight2_transposed) {
  return at::linear(h, weight2_transposed ? weight2.t() : weight2, bias2);
}

// Whether the forward keeps act'(z) rather than z for the backward (linear_act.h).
bool keeps_derivative(const at::Tensor& input, const at::Tensor& weight1,
                      const std::optional<at::Tensor>& bias1, Activation act,
                      bool weight1_transposed) {
#if FASTLAYERS_WITH_CUDA
  return linear_act_keeps_derivative(input, weight1, defined(bias1), act, weight1_transposed);
#else
  return false;
#endif
}

// h = act(linear1(input)), and for backward what the derivative reads: z, act'(z) where
// is_derivative, or h itself for ReLU.
struct FirstLayer {
  at::Tensor h;
  at::Tensor saved;
  bool is_derivative = false;
};

FirstLayer first_layer(const at::Tensor& input, const at::Tensor& weight1,
                       const std::optional<at::Tensor>& bias1, c10::string_view activation,
                       bool weight1_transposed, bool for_backward) {
  const Activation act = parse_activation(activation);
  const bool from_output = grad_from_output(act);
  const bool keeps = for_backward && !from_output;  // z or act'(z), a second output
  const bool derivative =
      keeps && keeps_derivative(input, weight1, bias1, act, weight1_transposed);
  auto [h, kept] = fwd_op().call(input, weight1, bias1, activation, weight1_transposed,
                                 keeps && !derivative, derivative);
  return {h, from_output ? h : kept, derivative};
}

void check_param(const at::Tensor& p, const at::Tensor& input, const char* name) {
  check_same_device(p, input, kOp, name, "input");
  TORCH_CHECK(p.scalar_type() == input.scalar_type(), kOp, ": ", name, " has dtype ",
              p.scalar_type(), " but input has dtype ", input.scalar_type(),
              "; they must match, as for torch.nn.functional.linear (under torch.autocast "
              "float32 parameters are cast for you)");
}

// One Linear's weight ([out, in], or stored [in, out] when transposed) and bias against the
// features it takes; returns its out_features.
int64_t check_layer(const at::Tensor& input, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool transposed, int64_t in_features,
                    const char* weight_name, const char* bias_name, const char* takes) {
  check_param(weight, input, weight_name);
  TORCH_CHECK(weight.dim() == 2, kOp, ": ", weight_name, " must be 2-D, got shape ",
              shape_str(weight.sizes()));
  const int64_t w_in = weight.size(transposed ? 0 : 1);
  const int64_t out = weight.size(transposed ? 1 : 0);
  TORCH_CHECK(w_in == in_features, kOp, ": ", weight_name, " of shape ",
              shape_str(weight.sizes()),
              transposed ? " (stored [in_features, out_features])"
                         : " (stored [out_features, in_features])",
              " does not take ", takes, " ", std::to_string(in_features), " features");
  if (defined(bias)) {
    check_param(*bias, input, bias_name);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out, kOp, ": ", bias_name,
                " must have shape [", std::to_string(out), "], got ", shape_str(bias->sizes()));
  }
  return out;
}

// Every argument, each error naming it (the layers' own checks would say "weight", "bias").
void check_mlp_args(const at::Tensor& input, const at::Tensor& weight1,
                    const std::optional<at::Tensor>& bias1, const at::Tensor& weight2,
                    const std::optional<at::Tensor>& bias2, bool weight1_transposed,
                    bool weight2_transposed) {
  check_input_dtype(input, kOp, "input");
  TORCH_CHECK(input.dim() >= 1, kOp, ": input must have at least one dimension");
  const int64_t hidden = check_layer(input, weight1, bias1, weight1_transposed, input.size(-1),
                                     "weight1", "bias1", "the input's");
  check_layer(input, weight2, bias2, weight2_transposed, hidden, "weight2", "bias2",
              "weight1's output");
}

// The op below autograd (CPU and CUDA alike: both layers dispatch to their own kernels).
at::Tensor linear_act_linear_impl(const at::Tensor& input, const at::Tensor& weight1,
                                  const std::optional<at::Tensor>& bias1,
                                  const at::Tensor& weight2,
                                  const std::optional<at::Tensor>& bias2,
                                  c10::string_view activation, bool weight1_transposed,
                                  bool weight2_transposed) {
  check_mlp_args(input, weight1, bias1, weight2, bias2, weight1_transposed, weight2_transposed);
  const at::Tensor h =
      first_layer(input, weight1, bias1, activation, weight1_transposed, /*for_backward=*/false).h;
  return linear2(h, weight2, bias2, weight2_transposed);
}

// Backward of linear_act_linear: saves input, both weights, the hidden h and what the first
// layer's backward reads (z or gelu'(z)); the second layer's input gradient and dz come from one
// GEMM (linear_act_dgrad), the rest from plain GEMMs.
class LinearActLinearBackward : public FusedNode {
 public:
  SavedVariable input, weight1, weight2, h, act_saved;
  std::string activation;
  bool saved_is_derivative = false, weight1_transposed = false, weight2_transposed = false;
  bool has_bias1 = false, has_bias2 = false;

  std::string name() const override { return "fastlayers::LinearActLinearBackward"; }

  // Edges: input, weight1, bias1, weight2, bias2 (an absent bias: an empty edge).
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "the native layers");
    variable_list out(5);
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    const at::Tensor x = unpack(input), w1 = unpack(weight1), w2 = unpack(weight2);
    const at::Tensor hidden = unpack(h), act = unpack(act_saved);
    const bool want_dx = should_compute_output(0), want_dw1 = should_compute_output(1);
    const bool want_db1 = has_bias1 && should_compute_output(2);
    const bool want_dw2 = should_compute_output(3);
    const bool want_db2 = has_bias2 && should_compute_output(4);

    const int64_t n1 = hidden.size(-1);
    const int64_t n2 = dy.size(-1);
    const int64_t m = rows_of(dy);
    const at::Tensor dy2 = dy.reshape({m, n2});
    const at::Tensor h2 = hidden.reshape({m, n1});
    if (want_dw2) out[3] = weight2_transposed ? at::mm(h2.t(), dy2) : at::mm(dy2.t(), h2);
    if (!(want_dx || want_dw1 || want_db1)) {
      if (want_db2) out[4] = column_sums_op().call(dy2);
      return out;
    }
    // db2 (dy's column sums) from the backward GEMM's op: its reduction's finish shares a launch
    // with db1's
    auto [dz, db1, db2] = dgrad_op().call(dy, w2, act, activation, weight2_transposed, want_db1,
                                          saved_is_derivative, want_db2);
    if (want_db2) out[4] = db2;
    const LinearDims d1{m, x.size(-1), n1};
    auto [dx, dw1, unused] = linear_act_grads_from_dz(dz.reshape({m, n1}), at::Tensor(), x, w1,
                                                      d1, weight1_transposed, want_dx, want_dw1);
    if (want_dx) out[0] = dx;
    if (want_dw1) out[1] = dw1;
    if (want_db1) out[2] = db1;
    return out;
  }

 protected:
  std::vector<SavedVariable*> saved() override {
    return {&input, &weight1, &weight2, &h, &act_saved};
  }
};

at::Tensor linear_act_linear_autograd(const at::Tensor& input, const at::Tensor& weight1,
                                      const std::optional<at::Tensor>& bias1,
                                      const at::Tensor& weight2,
                                      const std::optional<at::Tensor>& bias2,
                                      c10::string_view activation, bool weight1_transposed,
                                      bool weight2_transposed) {
  if (!records_grad(input, weight1, bias1, weight2, bias2)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return mlp_op().call(input, weight1, bias1, weight2, bias2, activation, weight1_transposed,
                         weight2_transposed);
  }
  NodePtr node_ptr = make_node<LinearActLinearBackward>();
  auto* node = static_cast<LinearActLinearBackward*>(node_ptr.get());
  node->set_next_edges(
      torch::autograd::collect_next_edges(input, weight1, bias1, weight2, bias2));
  at::AutoDispatchBelowADInplaceOrView guard;
  check_mlp_args(input, weight1, bias1, weight2, bias2, weight1_transposed, weight2_transposed);
  const FirstLayer first =
      first_layer(input, weight1, bias1, activation, weight1_transposed, /*for_backward=*/true);
  at::Tensor y = linear2(first.h, weight2, bias2, weight2_transposed);
  torch::autograd::set_history(y, node_ptr);
  node->input = SavedVariable(input, false);
  node->weight1 = SavedVariable(weight1, false);
  node->weight2 = SavedVariable(weight2, false);
  node->h = SavedVariable(first.h, false);
  node->act_saved = SavedVariable(first.saved, false);
  node->activation = std::string(activation);
  node->saved_is_derivative = first.is_derivative;
  node->weight1_transposed = weight1_transposed;
  node->weight2_transposed = weight2_transposed;
  node->has_bias1 = defined(bias1);
  node->has_bias2 = defined(bias2);
  return y;
}

// Autocast: both Linears run in the autocast dtype, as nn.Linear's do (float32 inputs and
// parameters cast, the parameter casts cached for the region).
template <c10::DeviceType kDevice, c10::DispatchKey kKey>
at::Tensor linear_act_linear_autocast(const at::Tensor& input, const at::Tensor& weight1,
                                      const std::optional<at::Tensor>& bias1,
                                      const at::Tensor& weight2,
                                      const std::optional<at::Tensor>& bias2,
                                      c10::string_view activation, bool weight1_transposed,
                                      bool weight2_transposed) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kKey);
  const at::ScalarType to = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!defined(t)) return t;
    return at::autocast::cached_cast(to, *t, kDevice);
  };
  return mlp_op().call(at::autocast::cached_cast(to, input, kDevice),
                       at::autocast::cached_cast(to, weight1, kDevice), cast(bias1),
                       at::autocast::cached_cast(to, weight2, kDevice), cast(bias2), activation,
                       weight1_transposed, weight2_transposed);
}

}  // namespace

at::Tensor linear_act_linear_eager(const at::Tensor& input, const at::Tensor& weight1,
                                   const std::optional<at::Tensor>& bias1,
                                   const at::Tensor& weight2,
                                   const std::optional<at::Tensor>& bias2,
                                   c10::string_view activation, bool weight1_transposed,
                                   bool weight2_transposed) {
  return mlp_op().call(input, weight1, bias1, weight2, bias2, activation, weight1_transposed,
                       weight2_transposed);
}

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def(
      "linear_act_linear(Tensor input, Tensor weight1, Tensor? bias1, Tensor weight2, "
      "Tensor? bias2, str activation, bool weight1_transposed, bool weight2_transposed) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) { m.impl("linear_act_linear", &linear_act_linear_impl); }

TORCH_LIBRARY_IMPL(fastlayers, CUDA, m) { m.impl("linear_act_linear", &linear_act_linear_impl); }

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("linear_act_linear", &linear_act_linear_autograd);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCUDA, m) {
  m.impl("linear_act_linear",
         &linear_act_linear_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCPU, m) {
  m.impl("linear_act_linear",
         &linear_act_linear_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

}  // namespace fastlayers
