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
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/graph_task.h>

#include <vector>

#include "common/widen.h"
#endif

namespace fastlayers {

namespace {

#ifdef FASTLAYERS_WITH_CUDA
bool widens(const at::Tensor& g) {
  const at::ScalarType from = g.scalar_type();
  return g.is_cuda() && (from == at::kBFloat16 || from == at::kHalf) && g.is_contiguous();
}

// g.to(kFloat) by widen.h's kernel (g: widens(g)).
at::Tensor widen_to_float(const at::Tensor& g) {
  at::Tensor out = at::empty(g.sizes(), g.options().dtype(at::kFloat));
  launch_widen_to_float(g.const_data_ptr(), g.scalar_type() == at::kBFloat16,
                        out.data_ptr<float>(), g.numel(),
                        at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                        at::cuda::getCurrentCUDAStream());
  return out;
}

// The float32 gradient a use of ours last handed the engine for one edge (x's producer and
// input number) in the current graph task, on this thread (each device's backward runs on one
// thread). Held weakly: alive with one strong reference, that reference is the engine's input
// buffer for the edge (see ConvertedUseBackward).
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct HandedGradient {
  torch::autograd::Node* next;
  uint32_t input_nr;
  WeakTensor sum;
  c10::Stream stream;  // the stream it was written on
};
struct HandedGradients {
  int task = -1;
  std::vector<HandedGradient> entries;
};

HandedGradients& handed_gradients() {
  thread_local HandedGradients handed;
  const int task = torch::autograd::get_current_graph_task_id();  // -1: not in a backward
  if (handed.task != task) {  // another backward: nothing handed in it yet
    handed.entries.clear();
    handed.task = task;
  }
  return handed;
}

// The buffer the engine is summing `edge`'s gradients in, where that is the gradient `handed`
// gave it in this backward and nothing else holds it (adding into it is then the engine's next
// addition); none otherwise.
std::optional<at::Tensor> engine_sum(const HandedGradient& handed, const at::Tensor& g,
                                     const torch::autograd::Edge& edge) {
  c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl = handed.sum.lock();
  if (!impl || impl.use_count() != 2) return std::nullopt;  // the buffer's reference and ours
  at::Tensor sum(std::move(impl));
  if (sum.storage().use_count() != 1 || !sum.is_contiguous() ||
      sum.scalar_type() != at::kFloat || sum.sizes() != g.sizes() || sum.device() != g.device())
    return std::nullopt;
  // one stream for the writer of the sum, this addition and the consumer: the engine orders a
  // buffer's producers before its consumer where it adds them, not an addition made later
  const c10::Stream current(at::cuda::getCurrentCUDAStream());
  const std::optional<c10::Stream> consumer = edge.function->stream();
  if (handed.stream != current || !consumer || *consumer != current) return std::nullopt;
  return sum;
}
#endif

// ToCopyBackward0's gradient: the use's gradient converted to the input's dtype. A 16-bit CUDA
// gradient is widened by widen.h's kernel (the same values, in the time of a copy). Where another
// use of ours already handed x's producer a float32 gradient in this backward and the engine's
// buffer still holds that very tensor, alone, this use adds its widened gradient into it in place
// (one pass; the engine's own next addition, buffer + gradient: the same bits) and hands the
// engine nothing. Another reader's gradient reaching the buffer in between replaces that tensor
// (a new sum: ours is then freed) or adds into it in place (then ours adds after it), so the
// additions always run in the engine's order.
class ConvertedUseBackward : public FusedNode {
 public:
  at::ScalarType input_dtype = at::kFloat;

  std::string name() const override { return "fastlayers::ConvertedUseBackward"; }

  variable_list apply(variable_list&& grads) override {
    refuse_double_backward("converted_use", "torch.autocast's own conversions (no patch)");
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
#ifdef FASTLAYERS_WITH_CUDA
    const torch::autograd::Edge& edge = next_edge(0);
    if (input_dtype == at::kFloat && widens(g) && edge.is_valid()) {
      const c10::cuda::CUDAGuard guard(g.device());
      // a post hook of this node sees its output: hand the engine one, as autocast's node would
      if (!post_hooks().empty() || torch::autograd::get_current_graph_task_id() < 0)
        return {widen_to_float(g)};
      HandedGradients& handed = handed_gradients();
      HandedGradient* entry = nullptr;
      for (HandedGradient& h : handed.entries)
        if (h.next == edge.function.get() && h.input_nr == edge.input_nr) entry = &h;
      if (entry != nullptr) {
        if (std::optional<at::Tensor> sum = engine_sum(*entry, g, edge)) {
          launch_add_widened(sum->data_ptr<float>(), g.const_data_ptr(),
                             g.scalar_type() == at::kBFloat16, g.numel(),
                             at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                             at::cuda::getCurrentCUDAStream());
          return {at::Tensor()};
        }
      }
      at::Tensor wide = widen_to_float(g);
      const c10::Stream current(at::cuda::getCurrentCUDAStream());
      if (entry != nullptr) {
        entry->sum = WeakTensor(wide.getIntrusivePtr());
        entry->stream = current;
      } else {
        handed.entries.push_back(
            {edge.function.get(), edge.input_nr, WeakTensor(wide.getIntrusivePtr()), current});
      }
      return {wide};
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
