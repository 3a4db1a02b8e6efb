// Fused Linear + activation op family (FusedLinearGELU, FusedLinearReLU): schemas, argument
// checks, CPU kernels, autograd and autocast.
//
//   linear_act_fwd(input, weight, bias?, activation, weight_transposed, save_preact,
//                  save_derivative=False)
//       -> (y, preact)              y = act(input . W^T + bias); preact = the GEMM + bias result z
//                                   when save_preact, act'(z) when save_derivative (GELU; what
//                                   linear_act_linear's backward GEMM multiplies by; no
//                                   autograd), else an empty tensor
//   linear_act_bwd(grad_out, saved, input, weight, has_bias, activation, weight_transposed,
//                  output_mask) -> (grad_input, grad_weight, grad_bias)
//   linear_act_dgrad(grad_out, weight, saved, activation, weight_transposed, want_db,
//                    saved_is_derivative=False, want_grad_out_sums=False)
//       -> (dz, db, grad_out_sums)  the backward of an MLP's activation through the next Linear
//                                   (weight): dz = act'(saved) * (grad_out . W) (saved * (grad_out
//                                   . W) when saved_is_derivative), db = sums of dz over rows,
//                                   grad_out_sums = sums of grad_out over rows (the next Linear's
//                                   bias gradient; linear_act.h); linear_act_linear.cpp uses it
//
// activation: 'gelu' (erf), 'gelu_tanh' or 'relu' (one Activation enum from here to the CUDA
// epilogue, csrc/common/activation.h). saved: the pre-activation for GELU; for ReLU the output y, which
// says where z > 0 (autograd then stores no pre-activation at all).
//
// W is weight [n, k], or weight [k, n] when weight_transposed (HuggingFace Conv1D stores it so).
// Autograd is registered here in C++ (Autograd key), so a call costs no Python glue.
#include "linear_act/linear_act.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.linear_act";

void check_param(const at::Tensor& p, const at::Tensor& input, const char* arg) {
  check_same_device(p, input, kOp, arg, "input");
  TORCH_CHECK(p.scalar_type() == input.scalar_type(), kOp, ": ", arg, " has dtype ",
              p.scalar_type(), " but input has dtype ", input.scalar_type(),
              "; they must match, as for torch.nn.functional.linear (under torch.autocast "
              "float32 parameters are cast for you)");
}
}  // namespace

Activation parse_activation(c10::string_view activation) {
  if (activation == "gelu") return Activation::kGeluErf;
  if (activation == "gelu_tanh") return Activation::kGeluTanh;
  if (activation == "relu") return Activation::kReLU;
  TORCH_CHECK(false, kOp, ": activation must be 'gelu', 'gelu_tanh' or 'relu', got '",
              std::string(activation), "'");
}

LinearDims check_linear_act_args(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, bool weight_transposed) {
  check_input_dtype(input, kOp, "input");
  TORCH_CHECK(input.dim() >= 1, kOp, ": input must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2, kOp, ": weight must be 2-D, got shape ",
              shape_str(weight.sizes()));
  check_param(weight, input, "weight");
  const int64_t k = input.size(-1);
  const int64_t w_k = weight.size(weight_transposed ? 0 : 1);
  const int64_t n = weight.size(weight_transposed ? 1 : 0);
  TORCH_CHECK(w_k == k, kOp, ": input of shape ", shape_str(input.sizes()),
              " does not match weight of shape ", shape_str(weight.sizes()),
              weight_transposed ? " (stored [in_features, out_features])"
                                : " (stored [out_features, in_features])",
              ": input's last dimension must be in_features = ", std::to_string(w_k));
  if (bias.has_value() && bias->defined()) {
    check_param(*bias, input, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, kOp, ": bias must have shape [",
                std::to_string(n), "] (out_features), got ", shape_str(bias->sizes()));
  }
  int64_t rows = 1;  // the leading dimensions, flattened
  for (int64_t d = 0; d + 1 < input.dim(); ++d) rows *= input.size(d);
  return {rows, k, n};
}

void check_save_args(Activation act, bool save_preact, bool save_derivative) {
  TORCH_CHECK(!(save_preact && save_derivative), kOp,
              ": save_preact and save_derivative cannot both be set (one tensor is kept)");
  TORCH_CHECK(!save_derivative || act == Activation::kGeluErf || act == Activation::kGeluTanh,
              kOp, ": save_derivative is for the GELU activations; ReLU's backward reads its "
              "output");
}

at::Tensor activation_derivative(const at::Tensor& z, Activation act) {
  return at::gelu_backward(at::ones_like(z), z,
                           act == Activation::kGeluTanh ? "tanh" : "none");
}

Activation dgrad_form(c10::string_view activation, bool saved_is_derivative) {
  const Activation act = parse_activation(activation);
  return saved_is_derivative ? Activation::kSavedDerivative : act;
}

std::vector<int64_t> linear_act_out_shape(const at::Tensor& input, int64_t n) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end() - 1);
  shape.push_back(n);
  return shape;
}

LinearDims check_linear_act_backward_args(const at::Tensor& grad_out, const at::Tensor& saved,
                                          const at::Tensor& input, const at::Tensor& weight,
                                          bool weight_transposed) {
  const LinearDims d = check_linear_act_args(input, weight, std::nullopt, weight_transposed);
  const auto out_shape = linear_act_out_shape(input, d.n);
  for (const at::Tensor* t : {&grad_out, &saved}) {
    const char* name = t == &grad_out ? "grad_out" : "saved";
    check_same_device(*t, input, kOp, name, "input");
    TORCH_CHECK(t->scalar_type() == input.scalar_type(), kOp, ": ", name, " has dtype ",
                t->scalar_type(), " but input has dtype ", input.scalar_type());
    TORCH_CHECK(t->sizes() == at::IntArrayRef(out_shape), kOp, ": ", name, " has shape ",
                shape_str(t->sizes()), " but the output has shape ", shape_str(out_shape));
  }
  return d;
}

LinearDims check_linear_act_dgrad_args(const at::Tensor& grad_out, const at::Tensor& weight,
                                       const at::Tensor& saved, bool weight_transposed) {
  // grad_out is the next Linear's output gradient: [..., n2] against weight [n2, n1] (or stored
  // [n1, n2]): the forward's checks with grad_out as input and the layout flipped.
  const LinearDims d = check_linear_act_args(grad_out, weight, std::nullopt, !weight_transposed);
  check_same_device(saved, grad_out, kOp, "saved", "grad_out");
  TORCH_CHECK(saved.scalar_type() == grad_out.scalar_type(), kOp, ": saved has dtype ",
              saved.scalar_type(), " but grad_out has dtype ", grad_out.scalar_type());
  const auto shape = linear_act_out_shape(grad_out, d.n);
  TORCH_CHECK(saved.sizes() == at::IntArrayRef(shape), kOp, ": saved has shape ",
              shape_str(saved.sizes()), " but grad_out . weight has shape ", shape_str(shape));
  return d;
}

int64_t rows_of(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

void check_column_sums_args(const at::Tensor& grad) {
  check_input_dtype(grad, "fastlayers.column_sums", "grad");
  TORCH_CHECK(grad.dim() >= 1, "fastlayers.column_sums: grad must have at least one dimension");
}

LinearActGrads linear_act_grads_from_dz(const at::Tensor& dz, const at::Tensor& db,
                                        const at::Tensor& input, const at::Tensor& weight,
                                        const LinearDims& d, bool weight_transposed, bool want_dx,
                                        bool want_dw) {
  const auto opts = input.options();
  at::Tensor dx = want_dx ? at::empty({d.m, d.k}, opts) : at::empty({0}, opts);
  at::Tensor dw = want_dw ? at::empty(weight.sizes(), opts) : at::empty({0}, opts);
  // y = x . W^T with W = weight ([n, k]) or weight^T (weight stored [k, n]).
  const at::Tensor x2 = input.reshape({d.m, d.k});
  if (want_dx) at::mm_out(dx, dz, weight_transposed ? weight.t() : weight);
  if (want_dw) {
    if (weight_transposed) {
      at::mm_out(dw, x2.t(), dz);  // [k, n]
    } else {
      at::mm_out(dw, dz.t(), x2);  // [n, k]
    }
  }
  return {want_dx ? dx.view(input.sizes()) : dx, dw, db.defined() ? db : at::empty({0}, opts)};
}

// ---------------------------------------------------------------------------------------------
// CPU kernels: the forward is torch.nn.functional.linear + gelu / relu as ATen computes them on
// CPU (its vectorised kernels: the native modules' numbers and speed); the backward's activation
// gradient in float (double for float64).
namespace {

// Rows per chunk of the bias-gradient partial sums: fixed, so the result does not depend on the
// number of threads.
constexpr int64_t kRowsPerChunk = 64;

// dz = dL/dz from dy and saved (z, or y for ReLU; dz may be null) and per-chunk column sums of dz
// (db_part may be null), in A = at::opmath_type<T>: float, or double for float64.
template <typename T, typename A = at::opmath_type<T>>
void dact_cpu_kernel(const T* dy, const T* saved, T* dz, A* db_part, int64_t m, int64_t n,
                     Activation act) {
  const int64_t chunks = (m + kRowsPerChunk - 1) / kRowsPerChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
    for (int64_t c = cbegin; c < cend; ++c) {
      A* part = db_part ? db_part + c * n : nullptr;
      const int64_t rend = std::min(m, (c + 1) * kRowsPerChunk);
      for (int64_t r = c * kRowsPerChunk; r < rend; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t i = r * n + j;
          const A g = activation_grad(static_cast<A>(dy[i]), static_cast<A>(saved[i]), act);
          if (dz) dz[i] = static_cast<T>(g);
          if (part) part[j] += g;
        }
      }
    }
  });
}

LinearActOutputs linear_act_fwd_cpu(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias,
                                    c10::string_view activation, bool weight_transposed,
                                    bool save_preact, bool save_derivative) {
  check_linear_act_args(input, weight, bias, weight_transposed);
  const Activation act = parse_activation(activation);
  check_save_args(act, save_preact, save_derivative);
  // at::linear itself, which picks addmm, or matmul and a separate bias add, by the shapes and
  // strides of its arguments (a 1-D input, a non-contiguous bias, ...): torch.nn.Linear's very
  // numbers for every layout. Its at::matmul also folds a >= 3-D input that is no view of a
  // matrix into one (a copy, then one GEMM) when the weight requires grad, and computes it by
  // batches otherwise (other roundings); below autograd the views it takes of weight would not
  // say that weight requires grad, so view tracking (ADInplaceOrView) is on again around the call,
  // as in inference mode; autograd stays off, nothing is recorded.
  at::Tensor z;
  {
    c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
    keys.excluded_ = keys.excluded_.remove(c10::DispatchKey::ADInplaceOrView);
    const c10::impl::ForceDispatchKeyGuard view_tracking(keys);
    const at::Tensor w = weight_transposed ? weight.t() : weight;  // [n, k]
    z = at::linear(input, w, bias);                                 // [..., n]
  }
  if (z.is_view()) {
    // at::linear may hand back a (tracked) view of its GEMM's result ([B, S, H] inputs): return
    // a plain alias instead, as native's outputs are fresh tensors (a view made under no_grad
    // cannot be modified in place once grad mode is on).
    const c10::impl::ExcludeDispatchKeyGuard no_view_tracking(c10::DispatchKey::ADInplaceOrView);
    z = at::alias(z);
  }
  // Out of place even when z is not kept: what native runs, and ATen's in-place GELU measured
  // 10-20% slower on CPU for float16/bfloat16 (benchmarks/bench_cpu.py).
  at::Tensor y = act == Activation::kReLU
                     ? at::relu(z)
                     : at::gelu(z, act == Activation::kGeluTanh ? "tanh" : "none");
  if (save_derivative) return {y, activation_derivative(z, act)};
  return {y, save_preact ? z : at::empty({0}, input.options())};
}

LinearActGrads linear_act_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& saved,
                                  const at::Tensor& input, const at::Tensor& weight,
                                  bool has_bias, c10::string_view activation,
                                  bool weight_transposed, std::array<bool, 3> output_mask) {
  const LinearDims d =
      check_linear_act_backward_args(grad_out, saved, input, weight, weight_transposed);
  const Activation act = parse_activation(activation);
  const bool want_dx = output_mask[0], want_dw = output_mask[1];
  const bool want_db = output_mask[2] && has_bias;
  const auto opts = input.options();
  const at::Tensor dy = grad_out.reshape({d.m, d.n}).contiguous();
  const at::Tensor s = saved.reshape({d.m, d.n}).contiguous();
  const bool need_dz = want_dx || want_dw;
  at::Tensor dz = need_dz ? at::empty({d.m, d.n}, opts) : at::Tensor();
  const int64_t chunks = (d.m + kRowsPerChunk - 1) / kRowsPerChunk;
  const auto acc_dtype = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor db_part = want_db ? at::zeros({chunks, d.n}, opts.dtype(acc_dtype)) : at::Tensor();
  dispatch_dtype_f64(input.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = at::opmath_type<T>;
    dact_cpu_kernel<T>(dy.data_ptr<T>(), s.data_ptr<T>(), need_dz ? dz.data_ptr<T>() : nullptr,
                       want_db ? db_part.data_ptr<A>() : nullptr, d.m, d.n, act);
  });
  const at::Tensor db = want_db ? db_part.sum(0).to(input.scalar_type()) : at::Tensor();
  return linear_act_grads_from_dz(dz, db, input, weight, d, weight_transposed, want_dx, want_dw);
}

// dz = act'(saved) * (grad_out . W2) as native autograd computes it on CPU (the GEMM's result
// rounded to the dtype, then the activation's derivative in float), db summed in fixed chunks.
DgradOutputs linear_act_dgrad_cpu(const at::Tensor& grad_out, const at::Tensor& weight,
                                  const at::Tensor& saved, c10::string_view activation,
                                  bool weight_transposed, bool want_db, bool saved_is_derivative,
                                  bool want_grad_out_sums) {
  const LinearDims d = check_linear_act_dgrad_args(grad_out, weight, saved, weight_transposed);
  const Activation act = dgrad_form(activation, saved_is_derivative);
  const at::Tensor dy = grad_out.reshape({d.m, d.k});
  const at::Tensor da = at::mm(dy, weight_transposed ? weight.t() : weight).contiguous();
  const at::Tensor s = saved.reshape({d.m, d.n}).contiguous();
  at::Tensor dz = at::empty({d.m, d.n}, saved.options());
  const int64_t chunks = (d.m + kRowsPerChunk - 1) / kRowsPerChunk;
  const auto acc_dtype = saved.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor db_part =
      want_db ? at::zeros({chunks, d.n}, saved.options().dtype(acc_dtype)) : at::Tensor();
  dispatch_dtype_f64(saved.scalar_type(), kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = at::opmath_type<T>;
    dact_cpu_kernel<T>(da.data_ptr<T>(), s.data_ptr<T>(), dz.data_ptr<T>(),
                       want_db ? db_part.data_ptr<A>() : nullptr, d.m, d.n, act);
  });
  const at::Tensor no_db = at::empty({0}, saved.options());
  at::Tensor db = want_db ? db_part.sum(0).to(saved.scalar_type()) : no_db;
  return {dz.view(saved.sizes()), db, want_grad_out_sums ? dy.sum(0) : no_db};
}

// ---------------------------------------------------------------------------------------------
// Autograd (C++): forward saves input, weight and what the activation's derivative is read from
// (the pre-activation for GELU, asked of the forward; the output itself for ReLU).

using FwdSig = LinearActOutputs(const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, c10::string_view, bool, bool,
                                 bool);
using BwdSig = LinearActGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, bool, c10::string_view, bool,
                               std::array<bool, 3>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = find_op<FwdSig>("fastlayers::linear_act_fwd");
  return op;
}

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = find_op<BwdSig>("fastlayers::linear_act_bwd");
  return op;
}

}  // namespace

at::Tensor linear_act_eager(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, c10::string_view activation,
                            bool weight_transposed) {
  return std::get<0>(
      fwd_op().call(input, weight, bias, activation, weight_transposed, false, false));
}

namespace {

// Backward of linear_act_fwd: saves input, weight and what the activation's derivative reads
// (y for ReLU, z otherwise); calls linear_act_bwd.
class LinearActBackward : public FusedNode {
 public:
  SavedVariable input, weight, act_saved;
  std::string activation;
  bool weight_transposed = false, has_bias = false;

  std::string name() const override { return "fastlayers::LinearActBackward"; }

  // Edges: input, weight, bias (absent: an empty edge).
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "torch.nn.functional.linear and the activation");
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const std::array<bool, 3> mask = {should_compute_output(0), should_compute_output(1),
                                      has_bias && should_compute_output(2)};
    auto [dx, dw, db] = bwd_op().call(dy, unpack(act_saved), unpack(input), unpack(weight),
                                      has_bias, activation, weight_transposed, mask);
    return {mask[0] ? dx : at::Tensor(), mask[1] ? dw : at::Tensor(),
            mask[2] ? db : at::Tensor()};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&input, &weight, &act_saved}; }
};

at::Tensor column_sums_cpu(const at::Tensor& grad) {
  check_column_sums_args(grad);
  return grad.reshape({rows_of(grad), grad.size(-1)}).sum(0);
}

// column_sums, like linear_act_dgrad, is a backward building block: not differentiable; this
// only steps below autograd.
at::Tensor column_sums_autograd(const at::Tensor& grad) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static const auto op = find_op<at::Tensor(const at::Tensor&)>("fastlayers::column_sums");
  return op.call(grad);
}

// linear_act_dgrad is a backward building block: not differentiable; this only steps below
// autograd.
DgradOutputs linear_act_dgrad_autograd(const at::Tensor& grad_out, const at::Tensor& weight,
                                       const at::Tensor& saved, c10::string_view activation,
                                       bool weight_transposed, bool want_db,
                                       bool saved_is_derivative, bool want_grad_out_sums) {
  at::AutoDispatchBelowADInplaceOrView guard;
  using DgradSig = DgradOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                c10::string_view, bool, bool, bool, bool);
  static const auto op = find_op<DgradSig>("fastlayers::linear_act_dgrad");
  return op.call(grad_out, weight, saved, activation, weight_transposed, want_db,
                 saved_is_derivative, want_grad_out_sums);
}

LinearActOutputs linear_act_fwd_autograd(const at::Tensor& input, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias,
                                         c10::string_view activation, bool weight_transposed,
                                         bool save_preact, bool save_derivative) {
  if (!records_grad(input, weight, bias)) {
    // Nothing to record: no autograd node, and no pre-activation stored unless asked for.
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(input, weight, bias, activation, weight_transposed, save_preact,
                         save_derivative);
  }
  TORCH_CHECK(!save_derivative, kOp,
              ": save_derivative=True is a building block of linear_act_linear's own backward "
              "and records no autograd; call it under torch.no_grad(), or use save_preact");
  NodePtr node_ptr = make_node<LinearActBackward>();
  auto* node = static_cast<LinearActBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  at::AutoDispatchBelowADInplaceOrView guard;
  const bool from_output = grad_from_output(parse_activation(activation));
  auto [y, preact] = fwd_op().call(input, weight, bias, activation, weight_transposed,
                                   save_preact || !from_output, false);
  torch::autograd::set_history(y, node_ptr);  // the pre-activation output gets no gradient
  node->input = SavedVariable(input, false);
  node->weight = SavedVariable(weight, false);
  node->act_saved = from_output ? SavedVariable(y, true) : SavedVariable(preact, false);
  node->activation = std::string(activation);
  node->weight_transposed = weight_transposed;
  node->has_bias = bias.has_value() && bias->defined();
  return {y, save_preact ? preact : at::empty({0}, input.options())};
}

// linear_act_bwd is not differentiable (LinearActBackward refuses create_graph);
// this kernel only steps below autograd, sparing the boxed fallback on every backward.
LinearActGrads linear_act_bwd_autograd(const at::Tensor& grad_out, const at::Tensor& saved,
                                       const at::Tensor& input, const at::Tensor& weight,
                                       bool has_bias, c10::string_view activation,
                                       bool weight_transposed, std::array<bool, 3> output_mask) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return bwd_op().call(grad_out, saved, input, weight, has_bias, activation, weight_transposed,
                       output_mask);
}

// Autocast: torch.nn.Linear runs in the autocast dtype (float32 input and parameters are cast,
// the parameter casts cached for the autocast region); the activation then runs on that output.
// Same here.
template <c10::DeviceType kDevice, c10::DispatchKey kKey>
LinearActOutputs linear_act_fwd_autocast(const at::Tensor& input, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias,
                                         c10::string_view activation, bool weight_transposed,
                                         bool save_preact, bool save_derivative) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kKey);
  const at::ScalarType to = at::autocast::get_autocast_dtype(kDevice);
  std::optional<at::Tensor> b = bias;
  if (b.has_value() && b->defined()) b = at::autocast::cached_cast(to, *b, kDevice);
  return fwd_op().call(at::autocast::cached_cast(to, input, kDevice),
                       at::autocast::cached_cast(to, weight, kDevice), b, activation,
                       weight_transposed, save_preact, save_derivative);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def(
      "linear_act_fwd(Tensor input, Tensor weight, Tensor? bias, str activation, "
      "bool weight_transposed, bool save_preact, bool save_derivative=False) "
      "-> (Tensor, Tensor)");
  m.def(
      "linear_act_bwd(Tensor grad_out, Tensor saved, Tensor input, Tensor weight, "
      "bool has_bias, str activation, bool weight_transposed, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_act_dgrad(Tensor grad_out, Tensor weight, Tensor saved, str activation, "
      "bool weight_transposed, bool want_db, bool saved_is_derivative=False, "
      "bool want_grad_out_sums=False) -> (Tensor, Tensor, Tensor)");
  m.def("column_sums(Tensor grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("linear_act_fwd", &linear_act_fwd_cpu);
  m.impl("linear_act_bwd", &linear_act_bwd_cpu);
  m.impl("linear_act_dgrad", &linear_act_dgrad_cpu);
  m.impl("column_sums", &column_sums_cpu);
}

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("linear_act_fwd", &linear_act_fwd_autograd);
  m.impl("linear_act_bwd", &linear_act_bwd_autograd);
  m.impl("linear_act_dgrad", &linear_act_dgrad_autograd);
  m.impl("column_sums", &column_sums_autograd);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCUDA, m) {
  m.impl("linear_act_fwd",
         &linear_act_fwd_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCPU, m) {
  m.impl("linear_act_fwd",
         &linear_act_fwd_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

}  // namespace fastlayers
