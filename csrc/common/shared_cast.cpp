// autocast_conversion, converted_use: see shared_cast.h. A plain entry of _C (not a dispatcher op): its output shares
// the storage of a tensor the caller holds, which an op schema cannot declare, and it runs only
// in eager calls (under torch.compile Inductor fuses the conversions itself).
//
// Why a node per use and not one node for all uses: the engine adds the gradients reaching x's
// producer in the order they arrive, mixed with those of x's other readers (a router beside a
// shared expert reads the same input). One node adding its uses' gradients itself would group
// the sum otherwise than native whenever x has another reader; a node per use, created where
// autocast creates its conversion node, arrives as native's does.
#include "common/shared_cast.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/autograd_node.h"
#ifdef FASTLAYERS_WITH_CUDA
#include "common/widen.h"
#endif

namespace fastlayers {

namespace {

// ToCopyBackward0's gradient: the use's gradient converted to the input's dtype (a 16-bit
// CUDA gradient widened to float32 by widen_to_float: the same values, in the time of a copy).
class ConvertedUseBackward : public FusedNode {
 public:
  at::ScalarType input_dtype = at::kFloat;

  std::string name() const override { return "fastlayers::ConvertedUseBackward"; }

  variable_list apply(variable_list&& grads) override {
    refuse_double_backward("converted_use", "torch.autocast's own conversions (no patch)");
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
#ifdef FASTLAYERS_WITH_CUDA
    if (input_dtype == at::kFloat) {
      if (std::optional<at::Tensor> wide = widen_to_float(g)) return {*std::move(wide)};
    }
#endif
    return {g.to(input_dtype)};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {}; }
};

}  // namespace

std::optional<at::Tensor> autocast_conversion(const at::Tensor& x) {
  const c10::DeviceType device_type = x.device().type();
  if (!at::autocast::is_autocast_available(device_type) ||
      !at::autocast::is_autocast_enabled(device_type))
    return std::nullopt;
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  const at::ScalarType from = x.scalar_type();
  if (!x.is_floating_point() || from == at::kDouble || from == dtype) return std::nullopt;
  if (x.requires_grad() && x.is_leaf()) return std::nullopt;
  at::NoGradGuard no_history;  // through the whole dispatcher: a dispatch mode sees it
  return x.to(dtype);
}

at::Tensor converted_use(const at::Tensor& x, const at::Tensor& converted) {
  TORCH_CHECK(x.is_floating_point() && converted.is_floating_point(),
              "converted_use: x and converted must be floating point, got ", x.scalar_type(),
              " and ", converted.scalar_type());
  TORCH_CHECK(x.scalar_type() != converted.scalar_type(),
              "converted_use: converted has x's dtype (", x.scalar_type(), "): nothing converted");
  TORCH_CHECK(x.sizes() == converted.sizes(), "converted_use: converted has shape ",
              converted.sizes(), ", x has ", x.sizes());
  TORCH_CHECK(x.device() == converted.device(), "converted_use: converted is on ",
              converted.device(), ", x on ", x.device());
  TORCH_CHECK(!converted.requires_grad(),
              "converted_use: converted must be computed outside autograd (x.detach().to(...))");
  at::Tensor out = converted.detach();  // a new tensor: one storage and version counter
  if (records_grad(x)) {
    NodePtr node = make_node<ConvertedUseBackward>();
    static_cast<ConvertedUseBackward*>(node.get())->input_dtype = x.scalar_type();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace fastlayers
