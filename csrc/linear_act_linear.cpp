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
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "linear_act.h"

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

template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

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

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class LinearActLinearFunction : public torch::autograd::Function<LinearActLinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                            const at::Tensor& weight2, const std::optional<at::Tensor>& bias2,
                            c10::string_view activation, bool weight1_transposed,
                            bool weight2_transposed) {
    at::AutoDispatchBelowADInplaceOrView guard;
    check_mlp_args(input, weight1, bias1, weight2, bias2, weight1_transposed, weight2_transposed);
    const FirstLayer first =
        first_layer(input, weight1, bias1, activation, weight1_transposed, /*for_backward=*/true);
    ctx->save_for_backward({input, weight1, weight2, first.h, first.saved});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["saved_is_derivative"] = first.is_derivative;
    ctx->saved_data["weight1_transposed"] = weight1_transposed;
    ctx->saved_data["weight2_transposed"] = weight2_transposed;
    ctx->saved_data["has_bias1"] = defined(bias1);
    ctx->saved_data["has_bias2"] = defined(bias2);
    return linear2(first.h, weight2, bias2, weight2_transposed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kOp,
                ": double backward (create_graph=True) is not supported; use the native layers "
                "where second derivatives are needed");
    variable_list out(8);
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight1 = saved[1], &weight2 = saved[2];
    const at::Tensor &h = saved[3], &act_saved = saved[4];
    const bool has_b1 = ctx->saved_data["has_bias1"].toBool();
    const bool has_b2 = ctx->saved_data["has_bias2"].toBool();
    const bool w1t = ctx->saved_data["weight1_transposed"].toBool();
    const bool w2t = ctx->saved_data["weight2_transposed"].toBool();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    // needs_input_grad counts the defined tensor arguments: input, weight1, bias1 if given,
    // weight2, bias2 if given; out[] is indexed by argument position.
    int next = 0;
    const bool want_dx = ctx->needs_input_grad(next++);
    const bool want_dw1 = ctx->needs_input_grad(next++);
    const bool want_db1 = has_b1 && ctx->needs_input_grad(next++);
    const bool want_dw2 = ctx->needs_input_grad(next++);
    const bool want_db2 = has_b2 && ctx->needs_input_grad(next++);

    const int64_t n1 = h.size(-1);
    const int64_t n2 = dy.size(-1);
    const int64_t m = rows_of(dy);
    const at::Tensor dy2 = dy.reshape({m, n2});
    const at::Tensor h2 = h.reshape({m, n1});
    if (want_dw2) out[3] = w2t ? at::mm(h2.t(), dy2) : at::mm(dy2.t(), h2);
    if (!(want_dx || want_dw1 || want_db1)) {
      if (want_db2) out[4] = column_sums_op().call(dy2);
      return out;
    }
    // db2 (dy's column sums) from the backward GEMM's op: its reduction's finish shares a launch
    // with db1's
    auto [dz, db1, db2] =
        dgrad_op().call(dy, weight2, act_saved, activation, w2t, want_db1,
                        ctx->saved_data["saved_is_derivative"].toBool(), want_db2);
    if (want_db2) out[4] = db2;
    const LinearDims d1{m, input.size(-1), n1};
    auto [dx, dw1, unused] = linear_act_grads_from_dz(dz.reshape({m, n1}), at::Tensor(), input,
                                                      weight1, d1, w1t, want_dx, want_dw1);
    if (want_dx) out[0] = dx;
    if (want_dw1) out[1] = dw1;
    if (want_db1) out[2] = db1;
    return out;
  }
};

at::Tensor linear_act_linear_autograd(const at::Tensor& input, const at::Tensor& weight1,
                                      const std::optional<at::Tensor>& bias1,
                                      const at::Tensor& weight2,
                                      const std::optional<at::Tensor>& bias2,
                                      c10::string_view activation, bool weight1_transposed,
                                      bool weight2_transposed) {
  const bool needs_grad =
      input.requires_grad() || weight1.requires_grad() || weight2.requires_grad() ||
      (defined(bias1) && bias1->requires_grad()) || (defined(bias2) && bias2->requires_grad());
  if (!at::GradMode::is_enabled() || !needs_grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return mlp_op().call(input, weight1, bias1, weight2, bias2, activation, weight1_transposed,
                         weight2_transposed);
  }
  return LinearActLinearFunction::apply(input, weight1, bias1, weight2, bias2, activation,
                                        weight1_transposed, weight2_transposed);
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
