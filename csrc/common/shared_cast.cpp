// shared_cast: see shared_cast.h. A plain entry of _C (not a dispatcher op): its outputs share
// one storage, which an op schema cannot declare, and it runs only in eager calls (under
// torch.compile Inductor fuses the conversions itself).
#include "common/shared_cast.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/autograd_node.h"

namespace fastlayers {

namespace {

// The backward: each use's gradient converted to the input's dtype and added, in output order.
// Native converts each gradient (ToCopyBackward) and the engine adds the results in arrival
// order; with two uses the order does not matter (IEEE addition commutes), so the sum is native's
// bits. A float32 (or float64) input adds the half-precision gradient inside the add (the
// widening is exact); a half input converts first, as native does, so both operands round alike.
class SharedCastBackward : public FusedNode {
 public:
  at::ScalarType input_dtype = at::kFloat;

  std::string name() const override { return "fastlayers::SharedCastBackward"; }

  variable_list apply(variable_list&& grads) override {
    refuse_double_backward("shared_cast", "autocast's own conversions (torch.autocast)");
    const bool widens = input_dtype == at::kFloat || input_dtype == at::kDouble;
    at::Tensor sum;
    for (const at::Tensor& g : grads) {
      if (!g.defined()) continue;
      if (!sum.defined()) {
        sum = g.to(input_dtype);  // a new tensor: the dtypes differ (checked in the forward)
      } else if (widens) {
        sum.add_(g);
      } else {
        sum.add_(g.to(input_dtype));
      }
    }
    return {sum};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {}; }
};

}  // namespace

std::vector<at::Tensor> shared_cast(const at::Tensor& x, at::ScalarType dtype, int64_t uses) {
  TORCH_CHECK(uses >= 1 && uses <= 8, "shared_cast: uses must be in [1, 8], got ", uses);
  TORCH_CHECK(x.is_floating_point() && at::isFloatingType(dtype),
              "shared_cast: x and dtype must be floating point, got ", x.scalar_type(), " and ",
              dtype);
  TORCH_CHECK(x.scalar_type() != dtype, "shared_cast: x is already ", dtype);
  const bool record = records_grad(x);
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the node below is the only record
    y = x.to(dtype);
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(uses);
  outputs.push_back(y);
  for (int64_t i = 1; i < uses; ++i) outputs.push_back(y.detach());
  if (record) {
    NodePtr node = make_node<SharedCastBackward>();
    static_cast<SharedCastBackward*>(node.get())->input_dtype = x.scalar_type();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    for (at::Tensor& out : outputs) torch::autograd::set_history(out, node);
  }
  return outputs;
}

}  // namespace fastlayers
