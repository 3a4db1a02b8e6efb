// dropout + residual add + LayerNorm op family: schemas, argument checks, CPU kernels, autograd
// and autocast. The semantics (rounding points, dtypes, the mask contract) are in
// dropout_add_layer_norm.h; the CUDA kernels live in dropout_add_layer_norm_cuda.cu.
//
// The CPU kernels compute s = dropout(x) + residual here and the normalisation by calling
// fastlayers::layer_norm_fwd/_bwd through the dispatcher: no second copy of the LayerNorm math.
// Autograd is registered in C++ (Autograd key), as LayerNorm's, so a call costs no Python glue.
#include "dropout_add_layer_norm/dropout_add_layer_norm.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <mutex>
#include <string>

#include "common/autograd_node.h"
#include "common/common.h"
#include "common/find_op.h"
#include "common/philox.h"

namespace fastlayers {

namespace {
constexpr const char* kOp = "fastlayers.dropout_add_layer_norm";

// "%g" through snprintf, not std::ostream (see shape_str in common.h: error messages must never
// crash where another libstdc++ is loaded).
std::string num_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_p(double p) {
  // Written so that NaN fails too. Worded as torch.nn.functional.dropout's message.
  TORCH_CHECK(p >= 0.0 && p <= 1.0, kOp,
              ": p (the dropout probability) has to be between 0 and 1, but got ", num_str(p));
}

void check_normalized_shape(const at::Tensor& t, const char* arg,
                            at::IntArrayRef normalized_shape) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1, kOp, ": normalized_shape must have at least one dimension");
  TORCH_CHECK(t.dim() >= k && t.sizes().slice(t.dim() - k) == normalized_shape, kOp, ": ", arg,
              " of shape ", shape_str(t.sizes()), " does not end with normalized_shape ",
              shape_str(normalized_shape));
}

// weight/bias: LayerNorm's rules (check_param_dtype in common.h) applied to the tensor that is
// normalised, the sum s of dtype `sum_dtype`: its dtype or float32; float64 sums take float64
// parameters only. `sum_name` says what s is in the message ("x" without a residual).
void check_param(const std::optional<at::Tensor>& p, const char* arg, const at::Tensor& ref,
                 const char* ref_name, at::ScalarType sum_dtype, const char* sum_name,
                 at::IntArrayRef normalized_shape) {
  if (!present(p)) return;
  check_same_device(*p, ref, kOp, arg, ref_name);
  const at::ScalarType pt = p->scalar_type();
  if (sum_dtype == at::kDouble) {
    TORCH_CHECK(pt == sum_dtype, kOp, ": ", arg, " has dtype ", pt, " but ", sum_name,
                " has dtype ", sum_dtype, "; a float64 sum needs float64 parameters");
  } else {
    TORCH_CHECK(pt == sum_dtype || pt == at::kFloat, kOp, ": ", arg, " has dtype ", pt, " but ",
                sum_name, " has dtype ", sum_dtype, "; ", arg, " must have that dtype or float32");
  }
  TORCH_CHECK(p->sizes() == normalized_shape, kOp, ": ", arg, " has shape ",
              shape_str(p->sizes()), " but normalized_shape is ", shape_str(normalized_shape));
}

RowsCols rows_cols(const at::Tensor& t, at::IntArrayRef normalized_shape) {
  int64_t cols = 1;
  for (int64_t s : normalized_shape) cols *= s;
  TORCH_CHECK(cols <= std::numeric_limits<int32_t>::max(), kOp,
              ": normalized_shape has more than 2^31-1 elements");
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}
}  // namespace

at::ScalarType dropout_add_sum_dtype(const at::Tensor& x,
                                     const std::optional<at::Tensor>& residual) {
  return present(residual) ? at::promote_types(x.scalar_type(), residual->scalar_type())
                           : x.scalar_type();
}

RowsCols check_dropout_add_layer_norm_args(const at::Tensor& x,
                                           const std::optional<at::Tensor>& residual,
                                           at::IntArrayRef normalized_shape,
                                           const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& bias, double p,
                                           std::optional<at::ScalarType> out_dtype) {
  check_input_dtype(x, kOp, "x");
  if (present(residual)) {
    check_input_dtype(*residual, kOp, "residual");
    check_same_device(*residual, x, kOp, "residual", "x");
    TORCH_CHECK(residual->sizes() == x.sizes(), kOp, ": residual has shape ",
                shape_str(residual->sizes()), " but x has shape ", shape_str(x.sizes()),
                "; they must be equal (no broadcasting)");
  }
  check_p(p);
  check_normalized_shape(x, "x", normalized_shape);
  const at::ScalarType sum_dtype = dropout_add_sum_dtype(x, residual);
  const char* sum_name = present(residual) ? "x + residual" : "x";
  check_param(weight, "weight", x, "x", sum_dtype, sum_name, normalized_shape);
  check_param(bias, "bias", x, "x", sum_dtype, sum_name, normalized_shape);
  if (out_dtype.has_value()) {
    TORCH_CHECK(*out_dtype == sum_dtype || (*out_dtype == at::kFloat && sum_dtype != at::kDouble),
                kOp, ": out_dtype must be the dtype of ", sum_name, " (", sum_dtype,
                ") or float32 (float64 sums: float64), got ", *out_dtype);
  }
  return rows_cols(x, normalized_shape);
}

// Validates the backward arguments, naming the bad one. Not declared in the header (which fixes
// the forward check only); the CUDA backward may declare and call it too.
RowsCols check_dropout_add_layer_norm_backward_args(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng_state,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double p, at::ScalarType x_dtype) {
  check_input_dtype(sum, kOp, "sum");
  const at::ScalarType sum_dtype = sum.scalar_type();
  check_input_dtype(grad_y, kOp, "grad_y");
  check_same_device(grad_y, sum, kOp, "grad_y", "sum");
  TORCH_CHECK(grad_y.sizes() == sum.sizes(), kOp, ": grad_y has shape ",
              shape_str(grad_y.sizes()), " but sum has shape ", shape_str(sum.sizes()),
              " (the forward must store the sum for the backward: store_sum=True)");
  check_normalized_shape(sum, "sum", normalized_shape);
  const at::ScalarType gy = grad_y.scalar_type();
  TORCH_CHECK(gy == sum_dtype || (gy == at::kFloat && sum_dtype != at::kDouble), kOp,
              ": grad_y must have the sum's dtype (", sum_dtype, ") or float32, got ", gy);
  if (present(grad_sum)) {
    check_same_device(*grad_sum, sum, kOp, "grad_sum", "sum");
    TORCH_CHECK(grad_sum->sizes() == sum.sizes(), kOp, ": grad_sum has shape ",
                shape_str(grad_sum->sizes()), " but sum has shape ", shape_str(sum.sizes()));
    TORCH_CHECK(grad_sum->scalar_type() == sum_dtype, kOp, ": grad_sum has dtype ",
                grad_sum->scalar_type(), " but sum has dtype ", sum_dtype);
  }
  const RowsCols rc = rows_cols(sum, normalized_shape);
  const at::ScalarType stat_dtype = layer_norm_stat_dtype(sum_dtype);
  for (const at::Tensor* stat : {&mean, &rstd}) {
    const char* name = stat == &mean ? "mean" : "rstd";
    check_same_device(*stat, sum, kOp, name, "sum");
    TORCH_CHECK(stat->scalar_type() == stat_dtype && stat->numel() == rc.rows, kOp, ": ", name,
                " must be a ", stat_dtype == at::kDouble ? "float64" : "float32", " tensor of ",
                std::to_string(rc.rows), " elements (one per row)");
  }
  check_same_device(rng_state, sum, kOp, "rng_state", "sum");
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.dim() == 1 &&
                  rng_state.size(0) == 2,
              kOp, ": rng_state must be an int64 tensor of shape [2] (seed, offset), got ",
              rng_state.scalar_type(), " of shape ", shape_str(rng_state.sizes()));
  check_p(p);
  TORCH_CHECK(is_supported_dtype(x_dtype) && at::promote_types(x_dtype, sum_dtype) == sum_dtype,
              kOp, ": x_dtype ", x_dtype, " cannot be the dtype of x for a sum of dtype ",
              sum_dtype);
  check_param(weight, "weight", sum, "sum", sum_dtype, "sum", normalized_shape);
  check_param(bias, "bias", sum, "sum", sum_dtype, "sum", normalized_shape);
  return rc;
}

// ---------------------------------------------------------------------------------------------
// CPU kernels
namespace {

// Philox groups (4 elements each) per parallel_for task: 10 rounds per group make a task of
// this size cost about as much as the thread hand-off.
constexpr int64_t kGroupsPerTask = 2048;

// (seed, offset) for one call from the default CPU generator, so that torch.manual_seed
// reproduces a run: seed = one 64-bit draw (the Mersenne Twister's next two words), offset = 0.
// Every call draws a fresh key, so calls never share a Philox stream.
std::array<uint64_t, 2> draw_cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return {at::check_generator<at::CPUGeneratorImpl>(gen)->random64(), 0};
}

// The scale of a kept element, 1 / (1 - p) in X's compute type (float for float32/half/bf16,
// double for float64), as ATen's fused dropout scales. p = 1 gives inf: never used, since the
// threshold keeps nothing.
template <typename X>
at::opmath_type<X> keep_scale(double p) {
  return static_cast<at::opmath_type<X>>(1.0 / (1.0 - p));
}

// Calls f(e, kept) for e in [0, n), kept as drawn for element e by the call's (seed, offset);
// one Philox call per group of 4 elements, groups split over threads.
template <typename F>
void for_each_element(int64_t n, uint64_t seed, uint64_t offset, double p, F&& f) {
  const uint32_t threshold = philox::keep_threshold(p);
  const int64_t groups = (n + 3) / 4;
  at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const philox::Words rnd = philox::random4(seed, offset, static_cast<uint64_t>(g));
      const int64_t e0 = 4 * g, m = std::min<int64_t>(4, n - e0);
      for (int64_t k = 0; k < m; ++k) f(e0 + k, rnd.w[k] < threshold);
    }
  });
}

// s[e] = round_S(d + r[e]), d = keep(e) ? round_X(x[e] * scale) : 0, over contiguous buffers;
// r may be null (no residual: s = d, S = X). One Philox call per group of 4 elements.
template <typename X, typename S>
void dropout_add_cpu_kernel(const X* x, const S* r, S* s, int64_t n, uint64_t seed,
                            uint64_t offset, double p) {
  using XC = at::opmath_type<X>;
  using SC = at::opmath_type<S>;
  const XC scale = keep_scale<X>(p);
  for_each_element(n, seed, offset, p, [&](int64_t e, bool kept) {
    const X d = kept ? static_cast<X>(static_cast<XC>(x[e]) * scale) : X(0);
    s[e] = r ? static_cast<S>(static_cast<SC>(d) + static_cast<SC>(r[e])) : static_cast<S>(d);
  });
}

// gx[e] = keep(e) ? round_X(round_X(ds[e]) * scale) : 0: dropout's backward of the gradient
// that autograd would hand it in x's dtype.
template <typename S, typename X>
void dropout_grad_cpu_kernel(const S* ds, X* gx, int64_t n, uint64_t seed, uint64_t offset,
                             double p) {
  using XC = at::opmath_type<X>;
  const XC scale = keep_scale<X>(p);
  for_each_element(n, seed, offset, p, [&](int64_t e, bool kept) {
    gx[e] = kept ? static_cast<X>(static_cast<XC>(static_cast<X>(ds[e])) * scale) : X(0);
  });
}

// s = dropout(x) + residual in dtype S, contiguous. `fresh`: s must not share x's memory (it is
// returned as the sum output).
at::Tensor dropout_add_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                           at::ScalarType sum_dtype, bool drop, uint64_t seed, uint64_t offset,
                           double p, bool fresh) {
  if (!drop) {
    // x + residual is native's own add (same vectorised kernel, same float rounding).
    if (present(residual)) return at::add(x.contiguous(), residual->contiguous());
    return fresh ? x.clone(at::MemoryFormat::Contiguous) : x.contiguous();
  }
  const at::Tensor xc = x.contiguous();
  // A residual of a narrower dtype than S is widened first (exact): one kernel per (X, S).
  // Not Tensor::to(dtype, ..., MemoryFormat::Contiguous): of a tensor already of that dtype it
  // returns a permuted or expanded one as it is (suggest_memory_format says Contiguous for it).
  at::Tensor rc;
  if (present(residual)) {
    rc = residual->scalar_type() == sum_dtype ? residual->contiguous()
                                              : residual->to(sum_dtype).contiguous();
  }
  at::Tensor s = at::empty(x.sizes(), x.options().dtype(sum_dtype));
  dispatch_dtype_f64(xc.scalar_type(), kOp, [&](auto x_tag) {
    using X = typename decltype(x_tag)::type;
    dispatch_dtype_f64(sum_dtype, kOp, [&](auto s_tag) {
      using S = typename decltype(s_tag)::type;
      dropout_add_cpu_kernel<X, S>(xc.data_ptr<X>(), rc.defined() ? rc.data_ptr<S>() : nullptr,
                                   s.data_ptr<S>(), xc.numel(), seed, offset, p);
    });
  });
  return s;
}

// grad_x from ds (dtype S). `alias_ok`: grad_x may be ds itself (grad_residual is not returned).
at::Tensor dropout_grad_cpu(const at::Tensor& ds, const at::Tensor& rng_state, double p,
                            bool dropout, at::ScalarType x_dtype, bool alias_ok) {
  if (!dropout) {
    if (ds.scalar_type() != x_dtype) return ds.to(x_dtype);
    return alias_ok ? ds : ds.clone();  // two outputs must not share memory
  }
  const at::Tensor rng = rng_state.contiguous();
  const uint64_t seed = static_cast<uint64_t>(rng.data_ptr<int64_t>()[0]);
  const uint64_t offset = static_cast<uint64_t>(rng.data_ptr<int64_t>()[1]);
  const at::Tensor dsc = ds.contiguous();
  at::Tensor gx = at::empty(ds.sizes(), ds.options().dtype(x_dtype));
  dispatch_dtype_f64(dsc.scalar_type(), kOp, [&](auto s_tag) {
    using S = typename decltype(s_tag)::type;
    dispatch_dtype_f64(x_dtype, kOp, [&](auto x_tag) {
      using X = typename decltype(x_tag)::type;
      dropout_grad_cpu_kernel<S, X>(dsc.data_ptr<S>(), gx.data_ptr<X>(), dsc.numel(), seed,
                                    offset, p);
    });
  });
  return gx;
}

// ---------------------------------------------------------------------------------------------
// Dispatcher handles (typed, looked up once).
using FwdSig = DropoutAddLayerNormOutputs(const at::Tensor&, const std::optional<at::Tensor>&,
                                          at::IntArrayRef, const std::optional<at::Tensor>&,
                                          const std::optional<at::Tensor>&, double, double, bool,
                                          bool, std::optional<at::ScalarType>);
using BwdSig = DropoutAddLayerNormGrads(const at::Tensor&, const std::optional<at::Tensor>&,
                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, at::IntArrayRef,
                                        const std::optional<at::Tensor>&,
                                        const std::optional<at::Tensor>&, double, bool,
                                        at::ScalarType, std::array<bool, 4>);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = find_op<FwdSig>("fastlayers::dropout_add_layer_norm_fwd");
  return op;
}
const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = find_op<BwdSig>("fastlayers::dropout_add_layer_norm_bwd");
  return op;
}

// ---------------------------------------------------------------------------------------------
// CPU ops

DropoutAddLayerNormOutputs dropout_add_layer_norm_fwd_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double p, bool training, bool store_sum,
    std::optional<at::ScalarType> out_dtype) {
  const RowsCols rc =
      check_dropout_add_layer_norm_args(x, residual, normalized_shape, weight, bias, p, out_dtype);
  const at::ScalarType sum_dtype = dropout_add_sum_dtype(x, residual);
  // No dropout, or nothing to drop (an empty x, as the CUDA kernels): zeros, and no random
  // number drawn (the generator's state is left as it was).
  const bool drop = dropout_active(p, training) && rc.rows > 0;
  std::array<uint64_t, 2> seed_offset = {0, 0};
  if (drop) seed_offset = draw_cpu_rng_state();
  at::Tensor rng_state = at::empty({2}, x.options().dtype(at::kLong));  // (0, 0): no mask
  rng_state.data_ptr<int64_t>()[0] = static_cast<int64_t>(seed_offset[0]);
  rng_state.data_ptr<int64_t>()[1] = static_cast<int64_t>(seed_offset[1]);
  const at::Tensor s = dropout_add_cpu(x, residual, sum_dtype, drop, seed_offset[0],
                                       seed_offset[1], p, /*fresh=*/store_sum);
  auto [y, mean, rstd] = layer_norm_fwd_op().call(s, normalized_shape, weight, bias, eps,
                                                  out_dtype);
  at::Tensor sum = store_sum ? s : at::empty({0}, x.options().dtype(sum_dtype));
  return {y, sum, mean, rstd, rng_state};
}

DropoutAddLayerNormGrads dropout_add_layer_norm_bwd_cpu(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng_state,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double p, bool dropout, at::ScalarType x_dtype,
    std::array<bool, 4> output_mask) {
  check_dropout_add_layer_norm_backward_args(grad_y, grad_sum, sum, mean, rstd, rng_state,
                                             normalized_shape, weight, bias, p, x_dtype);
  const bool want_ds = output_mask[0] || output_mask[1];
  auto [ds, dw, db] = layer_norm_bwd_op().call(grad_y, sum, mean, rstd, normalized_shape, weight,
                                               bias, {want_ds, output_mask[2], output_mask[3]});
  const auto empty = [&] { return at::empty({0}, sum.options()); };
  if (!want_ds) return {empty(), empty(), dw, db};
  // ds is layer_norm_bwd's fresh dx (dtype S): the prenorm gradient is added in place, rounded
  // to S as autograd accumulates the two gradients of s.
  if (present(grad_sum)) ds.add_(*grad_sum);
  at::Tensor dx = output_mask[0] ? dropout_grad_cpu(ds, rng_state, p, dropout, x_dtype,
                                                    /*alias_ok=*/!output_mask[1])
                                 : empty();
  return {dx, output_mask[1] ? ds : empty(), dw, db};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Autograd (C++): the forward saves s, mean, rstd, rng_state (the mask is regenerated from it,
// never stored), weight, bias; the backward calls dropout_add_layer_norm_bwd.

std::tuple<at::Tensor, at::Tensor> dropout_add_layer_norm_eager(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double p, bool training, bool store_sum) {
  auto out = fwd_op().call(x, residual, normalized_shape, weight, bias, eps, p, training,
                           store_sum, std::nullopt);
  return {std::get<0>(out), std::get<1>(out)};
}

namespace {

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Backward of dropout_add_layer_norm_fwd: saves s (the sum, whether or not the caller asked
// for it), mean, rstd, the dropout's RNG state, weight and bias; calls the backward op.
class DropoutAddLayerNormBackward : public FusedNode {
 public:
  SavedVariable sum, mean, rstd, rng_state, weight, bias;
  double p = 0.0;
  bool dropout = false;
  at::ScalarType x_dtype = at::kFloat, y_dtype = at::kFloat;
  std::optional<at::ScalarType> residual_dtype;  // none: no residual

  std::string name() const override { return "fastlayers::DropoutAddLayerNormBackward"; }

  // Inputs: the gradients of y and (prenorm) of s. Edges: x, residual, weight, bias (an absent
  // one: an empty edge).
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_double_backward(kOp,
                           "torch.nn.functional.layer_norm(torch.nn.functional.dropout(x, p) + "
                           "residual)");
    variable_list out(4);
    at::Tensor dy = grads[0];
    const at::Tensor dsum = grads.size() > 1 ? grads[1] : at::Tensor();
    if (!dy.defined() && !dsum.defined()) return out;
    const at::Tensor s = unpack(sum), m = unpack(mean), r = unpack(rstd), rng = unpack(rng_state);
    const std::optional<at::Tensor> w = unpack_optional(weight), b = unpack_optional(bias);
    // Only s was used: y's gradient is zero, and weight/bias get none (as autograd gives a
    // parameter that the loss does not reach through y).
    const bool y_used = dy.defined();
    if (!y_used) dy = at::zeros(s.sizes(), s.options().dtype(y_dtype));
    const std::array<bool, 4> mask = {
        should_compute_output(0), residual_dtype.has_value() && should_compute_output(1),
        y_used && w.has_value() && should_compute_output(2),
        y_used && b.has_value() && should_compute_output(3)};
    const at::IntArrayRef normalized_shape = s.sizes().slice(m.dim());
    auto [dx, dres, dw, db] = bwd_op().call(dy, opt(dsum), s, m, r, rng, normalized_shape, w, b,
                                            p, dropout, x_dtype, mask);
    if (mask[0]) out[0] = dx;
    if (mask[1]) out[1] = dres.scalar_type() == *residual_dtype ? dres : dres.to(*residual_dtype);
    if (mask[2]) out[2] = dw;
    if (mask[3]) out[3] = db;
    return out;
  }

 protected:
  std::vector<SavedVariable*> saved() override {
    return {&sum, &mean, &rstd, &rng_state, &weight, &bias};
  }
};

DropoutAddLayerNormOutputs dropout_add_layer_norm_fwd_autograd(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double p, bool training, bool store_sum,
    std::optional<at::ScalarType> out_dtype) {
  if (!records_grad(x, residual, weight, bias)) {
    // Nothing to record: skip the autograd node and its bookkeeping (inference host time).
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(x, residual, normalized_shape, weight, bias, eps, p, training,
                         store_sum, out_dtype);
  }
  NodePtr node_ptr = make_node<DropoutAddLayerNormBackward>();
  auto* node = static_cast<DropoutAddLayerNormBackward*>(node_ptr.get());
  node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight, bias));
  at::AutoDispatchBelowADInplaceOrView guard;
  // The backward needs s whether or not the caller asked for it.
  auto [y, sum, mean, rstd, rng_state] = fwd_op().call(
      x, residual, normalized_shape, weight, bias, eps, p, training, true, out_dtype);
  // The op's contract: the sum output is empty unless asked for (the fake kernel says so).
  const at::Tensor sum_out = store_sum ? sum : at::empty({0}, sum.options());
  torch::autograd::set_history(y, node_ptr);  // output 0
  if (store_sum) torch::autograd::set_history(sum_out, node_ptr);  // output 1 (prenorm)
  node->sum = SavedVariable(sum, store_sum);
  node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  node->rng_state = SavedVariable(rng_state, false);
  node->weight = SavedVariable(weight, false);
  node->bias = SavedVariable(bias, false);
  node->p = p;
  node->dropout = dropout_active(p, training);
  node->x_dtype = x.scalar_type();
  node->y_dtype = y.scalar_type();
  if (present(residual)) node->residual_dtype = residual->scalar_type();
  return {y, sum_out, mean, rstd, rng_state};
}

// The backward op is not differentiable (DropoutAddLayerNormBackward refuses create_graph); this
// kernel only steps below autograd, sparing the boxed fallback on every backward.
DropoutAddLayerNormGrads dropout_add_layer_norm_bwd_autograd(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& rng_state,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double p, bool dropout, at::ScalarType x_dtype,
    std::array<bool, 4> output_mask) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return bwd_op().call(grad_y, grad_sum, sum, mean, rstd, rng_state, normalized_shape, weight,
                       bias, p, dropout, x_dtype, output_mask);
}

// Autocast gives the native sequence F.layer_norm(F.dropout(x) + residual) these dtypes:
// dropout and add are on no autocast list (s keeps the promoted dtype S), layer_norm is on
// CUDA's float32 list (y float32 for half/bf16 sums; weight and bias cast to float32 unless
// float64). We return that y dtype, reading the half-precision s directly (its cast to float32
// is exact). Only CUDA: CPU autocast leaves layer_norm alone (torch.autocast('cpu') returns a
// bf16 layer_norm for a bf16 input), so the op's plain CPU kernel already gives native's dtype,
// and LayerNorm registers no AutocastCPU kernel either.
DropoutAddLayerNormOutputs dropout_add_layer_norm_fwd_autocast_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double p, bool training, bool store_sum,
    std::optional<at::ScalarType> out_dtype) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const at::ScalarType sum_dtype = dropout_add_sum_dtype(x, residual);
  const auto as_eligible = [&](const std::optional<at::Tensor>& p) -> std::optional<at::Tensor> {
    if (!present(p) || !p->is_floating_point()) return p;
    const at::ScalarType pt = p->scalar_type();
    if (pt == sum_dtype || pt == at::kFloat || pt == at::kDouble) return p;  // autocast: as is
    return p->to(at::kFloat);  // autocast casts it to float32 as well
  };
  std::optional<at::ScalarType> od = out_dtype;
  if (!od.has_value() && x.is_cuda() &&
      (sum_dtype == at::kHalf || sum_dtype == at::kBFloat16)) {
    od = at::kFloat;
  }
  return fwd_op().call(x, residual, normalized_shape, as_eligible(weight), as_eligible(bias), eps,
                       p, training, store_sum, od);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastlayers, m) {
  // nondeterministic_seeded: the forward draws from the global generator, so compilers must
  // neither merge two calls nor recompute one in the backward (a new mask).
  m.def(
      "dropout_add_layer_norm_fwd(Tensor x, Tensor? residual, int[] normalized_shape, "
      "Tensor? weight, Tensor? bias, float eps, float p, bool training, bool store_sum, "
      "ScalarType? out_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "dropout_add_layer_norm_bwd(Tensor grad_y, Tensor? grad_sum, Tensor sum, Tensor mean, "
      "Tensor rstd, Tensor rng_state, int[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float p, bool dropout, ScalarType x_dtype, bool[4] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastlayers, CPU, m) {
  m.impl("dropout_add_layer_norm_fwd", &dropout_add_layer_norm_fwd_cpu);
  m.impl("dropout_add_layer_norm_bwd", &dropout_add_layer_norm_bwd_cpu);
}

TORCH_LIBRARY_IMPL(fastlayers, Autograd, m) {
  m.impl("dropout_add_layer_norm_fwd", &dropout_add_layer_norm_fwd_autograd);
  m.impl("dropout_add_layer_norm_bwd", &dropout_add_layer_norm_bwd_autograd);
}

TORCH_LIBRARY_IMPL(fastlayers, AutocastCUDA, m) {
  m.impl("dropout_add_layer_norm_fwd", &dropout_add_layer_norm_fwd_autocast_cuda);
}

}  // namespace fastlayers
