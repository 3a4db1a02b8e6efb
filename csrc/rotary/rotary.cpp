// Rotary embedding op family: schema, argument checks, the ATen composites (the CPU kernels, bit
// for bit the models' own op sequences; rotary.h states them) and autograd (C++, a FusedNode that
// saves cos and sin only: the backward of a rotation needs no input).
#include "rotary/rotary.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <limits>
#include <string>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.rotary";
constexpr int64_t kEnd = std::numeric_limits<int64_t>::max();

bool has(int64_t form, int64_t flag) { return (form & flag) != 0; }
}  // namespace

namespace {
void check_form(int64_t form) {
  TORCH_CHECK_VALUE(form >= 0 && form <= kRotaryFlags, kOp, ": form must be a combination of ",
                    "the rotary flags (0 to ", kRotaryFlags, "), got ", form);
}

// cos and sin (dtype, dims, sin like cos) and unsqueeze_dim: what both passes check.
void check_cos_sin(const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim) {
  check_input_dtype(cos, kOp, "cos");
  TORCH_CHECK(cos.dim() >= 1, kOp, ": cos must have at least one dimension, got a 0-dim tensor");
  TORCH_CHECK(sin.scalar_type() == cos.scalar_type(), kOp, ": sin has dtype ", sin.scalar_type(),
              " but cos has dtype ", cos.scalar_type(), "; they must match");
  TORCH_CHECK(sin.sizes() == cos.sizes(), kOp, ": sin has shape ", shape_str(sin.sizes()),
              " but cos has shape ", shape_str(cos.sizes()), "; they must match");
  const int64_t dims = cos.dim() + 1;
  TORCH_CHECK_INDEX(unsqueeze_dim >= -dims && unsqueeze_dim < dims, kOp,
                    ": unsqueeze_dim must be in [", -dims, ", ", dims - 1, "] for cos of ",
                    cos.dim(), " dimensions, got ", unsqueeze_dim);
}
}  // namespace

void check_rotary_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form) {
  check_form(form);
  check_input_dtype(q, kOp, "q");
  TORCH_CHECK(q.dim() >= 1, kOp, ": q must have at least one dimension, got a 0-dim tensor");
  check_same_device(k, q, kOp, "k", "q");
  check_same_device(cos, q, kOp, "cos", "q");
  check_same_device(sin, q, kOp, "sin", "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), kOp, ": k has dtype ", k.scalar_type(),
              " but q has dtype ", q.scalar_type(), "; they must match");
  TORCH_CHECK(k.dim() == q.dim(), kOp, ": k has ", k.dim(), " dimensions but q has ", q.dim(),
              "; they must match");
  check_cos_sin(cos, sin, unsqueeze_dim);
}

at::ScalarType rotary_out_dtype(at::ScalarType q_dtype, at::ScalarType cos_dtype, int64_t form) {
  if (has(form, kRotaryCastBack)) return q_dtype;
  return at::promote_types(has(form, kRotaryUpcast) ? at::kFloat : q_dtype, cos_dtype);
}

namespace {

// rotate_half (cat(-r2, r1)) or the interleaved form (stack([-r[1::2], r[::2]], -1).flatten(-2)).
at::Tensor rotate(const at::Tensor& r, bool interleaved) {
  if (interleaved) {
    const at::Tensor odd = r.slice(-1, 1, kEnd, 2), even = r.slice(-1, 0, kEnd, 2);
    return at::stack({at::neg(odd), even}, -1).flatten(-2);
  }
  const int64_t h = r.size(-1) / 2;
  return at::cat({at::neg(r.slice(-1, h)), r.slice(-1, 0, h)}, -1);
}

// rotate's transpose: what native autograd gives r for a gradient u of rotate(r).
at::Tensor rotate_t(const at::Tensor& u, bool interleaved) {
  if (interleaved) {
    const at::Tensor even = u.slice(-1, 0, kEnd, 2), odd = u.slice(-1, 1, kEnd, 2);
    return at::stack({odd, at::neg(even)}, -1).flatten(-2);
  }
  const int64_t h = u.size(-1) - u.size(-1) / 2;  // rotate's first part is r[h:] of r's halves
  return at::cat({u.slice(-1, h), at::neg(u.slice(-1, 0, h))}, -1);
}

// x's rotation, op for op as the model computes it (kRotaryUpcastEach: x.float() per use).
at::Tensor rotate_one(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s,
                      int64_t form) {
  const bool upcast = has(form, kRotaryUpcast), partial = has(form, kRotaryPartial);
  const int64_t dr = c.size(-1);
  auto rotated_part = [&] {
    const at::Tensor xc = upcast ? x.to(at::kFloat) : x;
    return partial ? xc.slice(-1, 0, dr) : xc;
  };
  const at::Tensor r = rotated_part();
  const at::Tensor r2 = upcast && has(form, kRotaryUpcastEach) ? rotated_part() : r;
  at::Tensor y = at::add(at::mul(r, c), at::mul(rotate(r2, has(form, kRotaryInterleaved)), s));
  if (partial) y = at::cat({y, (upcast ? x.to(at::kFloat) : x).slice(-1, dr)}, -1);
  if (has(form, kRotaryCastBack)) y = y.to(x.scalar_type());
  return y;
}

// The gradient of x from g (the output's gradient), as native autograd computes it.
at::Tensor rotate_one_backward(const at::Tensor& g, const at::Tensor& c, const at::Tensor& s,
                               int64_t form, at::ScalarType x_dtype) {
  const bool upcast = has(form, kRotaryUpcast);
  const at::ScalarType xc_dtype = upcast ? at::kFloat : x_dtype;
  const at::ScalarType sum_dtype = upcast && !has(form, kRotaryUpcastEach) ? at::kFloat : x_dtype;
  const at::ScalarType compute = at::promote_types(xc_dtype, c.scalar_type());
  const at::Tensor gc = has(form, kRotaryCastBack) ? g.to(compute) : g;
  at::Tensor gr = gc, gp;
  if (has(form, kRotaryPartial)) {
    const int64_t dr = c.size(-1);
    gr = gc.slice(-1, 0, dr);
    gp = gc.slice(-1, dr);
  }
  // each product's grad is cast to its operand's dtype (xc's), then to the dtype of the sum
  const at::Tensor t1 = at::mul(gr, c).to(xc_dtype).to(sum_dtype);
  const at::Tensor u = at::mul(gr, s).to(xc_dtype).to(sum_dtype);
  at::Tensor dx = at::add(t1, rotate_t(u, has(form, kRotaryInterleaved)));
  if (gp.defined()) dx = at::cat({dx, gp.to(sum_dtype)}, -1);
  return dx.to(x_dtype);
}

}  // namespace

at::Tensor rotary_out_like(const at::Tensor& x, at::IntArrayRef shape, at::ScalarType dtype,
                           int64_t form) {
  if (!has(form, kRotaryPartial) && shape == x.sizes()) {
    return at::empty_like(x, x.options().dtype(dtype));
  }
  return at::empty(shape, x.options().dtype(dtype));
}

namespace {
// y in the layout rotary_out_like gives (what the native ops give in the models' calls; the CUDA
// kernels and the fake kernels give it always).
at::Tensor in_out_layout(const at::Tensor& y, const at::Tensor& x, int64_t form) {
  at::Tensor out = rotary_out_like(x, y.sizes(), y.scalar_type(), form);
  if (out.strides() == y.strides()) return y;
  return out.copy_(y);
}
}  // namespace

RotaryPair rotary_native(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form) {
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  return {rotate_one(q, c, s, form), rotate_one(k, c, s, form)};
}

RotaryPair rotary_fwd_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form) {
  check_rotary_args(q, k, cos, sin, unsqueeze_dim, form);
  auto [q_out, k_out] = rotary_native(q, k, cos, sin, unsqueeze_dim, form);
  return {in_out_layout(q_out, q, form), in_out_layout(k_out, k, form)};
}

RotaryPair rotary_bwd_composite(const std::optional<at::Tensor>& grad_q,
                                const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                                at::ScalarType q_dtype) {
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  auto one = [&](const std::optional<at::Tensor>& g) {
    if (!g.has_value() || !g->defined()) return at::empty({0}, cos.options().dtype(q_dtype));
    // the grad's layout (the fake kernel's and CUDA's): the views' backward then copies nothing
    const at::Tensor d = rotate_one_backward(*g, c, s, form, q_dtype);
    const at::Tensor out = at::empty_like(*g, g->options().dtype(q_dtype));
    return out.strides() == d.strides() ? d : out.copy_(d);
  };
  return {one(grad_q), one(grad_k)};
}

void check_rotary_bwd_args(const std::optional<at::Tensor>& grad_q,
                           const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                           at::ScalarType q_dtype) {
  TORCH_CHECK_VALUE(is_supported_dtype(q_dtype), kOp,
                    ": q_dtype must be float32, float64, float16 or bfloat16, got ", q_dtype);
  for (const auto* g : {&grad_q, &grad_k}) {
    if (g->has_value() && (*g)->defined()) {
      check_input_dtype(**g, kOp, g == &grad_q ? "grad_q" : "grad_k");
      check_same_device(**g, cos, kOp, g == &grad_q ? "grad_q" : "grad_k", "cos");
    }
  }
  check_form(form);
  check_same_device(sin, cos, kOp, "sin", "cos");
  check_cos_sin(cos, sin, unsqueeze_dim);
}

namespace {

RotaryPair rotary_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                          const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form) {
  return rotary_fwd_composite(q, k, cos, sin, unsqueeze_dim, form);
}

RotaryPair rotary_bwd_cpu(const std::optional<at::Tensor>& grad_q,
                          const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                          const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                          at::ScalarType q_dtype) {
  check_rotary_bwd_args(grad_q, grad_k, cos, sin, unsqueeze_dim, form, q_dtype);
  return rotary_bwd_composite(grad_q, grad_k, cos, sin, unsqueeze_dim, form, q_dtype);
}

// ---------------------------------------------------------------------------------------------
// Autograd (C++, a FusedNode): saves cos and sin; backward calls rotary_bwd.

using FwdSig = RotaryPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, int64_t, int64_t);
using BwdSig = RotaryPair(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                          const at::Tensor&, const at::Tensor&, int64_t, int64_t, at::ScalarType);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = find_op<FwdSig>("fastlayers::rotary_fwd");
  return op;
}

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = find_op<BwdSig>("fastlayers::rotary_bwd");
  return op;
}

class RotaryBackward : public FusedNode {
 public:
  SavedVariable cos, sin;
  int64_t unsqueeze_dim = 1, form = 0;
  at::ScalarType q_dtype = at::kFloat;

  std::string name() const override { return "fastlayers::RotaryBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp, "the model's native apply_rotary_pos_emb");
    const bool want_q = should_compute_output(0) && grads[0].defined();
    const bool want_k = should_compute_output(1) && grads[1].defined();
    if (!want_q && !want_k) return {at::Tensor(), at::Tensor()};
    auto opt = [](bool want, const at::Tensor& g) {
      return want ? std::optional<at::Tensor>(g) : std::nullopt;
    };
    auto [dq, dk] = bwd_op().call(opt(want_q, grads[0]), opt(want_k, grads[1]), unpack(cos),
                                  unpack(sin), unsqueeze_dim, form, q_dtype);
    return {want_q ? dq : at::Tensor(), want_k ? dk : at::Tensor()};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {&cos, &sin}; }
};

// A call the op's kernels and node do not cover, which the model's function computes all the same:
// q and k of two dtypes, cos and sin of two dtypes or shapes (promoted, broadcast), or cos / sin
// requiring grad. It runs the model's composite with native autograd.
bool unusual(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
             const at::Tensor& sin) {
  return k.scalar_type() != q.scalar_type() || sin.scalar_type() != cos.scalar_type() ||
         !sin.sizes().equals(cos.sizes()) || requires_grad(cos) || requires_grad(sin);
}

RotaryPair rotary_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form) {
  if (unusual(q, k, cos, sin)) return rotary_native(q, k, cos, sin, unsqueeze_dim, form);
  if (!records_grad(q, k, cos, sin)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(q, k, cos, sin, unsqueeze_dim, form);
  }
  NodePtr node_ptr = make_node<RotaryBackward>();
  auto* node = static_cast<RotaryBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(q, k));
  auto [q_out, k_out] = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(q, k, cos, sin, unsqueeze_dim, form);
  }();
  torch::autograd::set_history(q_out, node_ptr);
  torch::autograd::set_history(k_out, node_ptr);
  node->cos = SavedVariable(cos, false);
  node->sin = SavedVariable(sin, false);
  node->unsqueeze_dim = unsqueeze_dim;
  node->form = form;
  node->q_dtype = q.scalar_type();
  return {q_out, k_out};
}

// rotary_bwd is not differentiable (the node refuses create_graph); this kernel only steps below
// autograd, sparing the boxed default fallback on every backward.
RotaryPair rotary_bwd_autograd(const std::optional<at::Tensor>& grad_q,
                               const std::optional<at::Tensor>& grad_k, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form,
                               at::ScalarType q_dtype) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return bwd_op().call(grad_q, grad_k, cos, sin, unsqueeze_dim, form, q_dtype);
}

}  // namespace

RotaryPair rotary_eager(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t unsqueeze_dim, int64_t form) {
  return fwd_op().call(q, k, cos, sin, unsqueeze_dim, form);
}

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  m.def(
      "rotary_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim, int form) -> "
      "(Tensor q_out, Tensor k_out)");
  m.def(
      "rotary_bwd(Tensor? grad_q, Tensor? grad_k, Tensor cos, Tensor sin, int unsqueeze_dim, "
      "int form, ScalarType q_dtype) -> (Tensor grad_q_in, Tensor grad_k_in)");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("rotary_fwd", &rotary_fwd_cpu);
  m.impl("rotary_bwd", &rotary_bwd_cpu);
}

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("rotary_fwd", &rotary_fwd_autograd);
  m.impl("rotary_bwd", &rotary_bwd_autograd);
}

}  // namespace fastlayers
