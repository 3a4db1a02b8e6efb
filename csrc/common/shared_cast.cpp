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
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <array>
#include <typeinfo>
#include <unordered_map>
#include <vector>

#include "common/widen.h"
#endif

namespace fastlayers {

namespace {

// ToCopyBackward0's gradient: the use's gradient converted to the input's dtype. A 16-bit CUDA
// gradient is widened by widen.h's kernel (the same values, in the time of a copy); where the
// engine's buffer for x's producer already holds the float32 gradient another use of ours handed
// it in this backward, this use adds into that buffer instead (engine_sum below).
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
      if (std::optional<at::Tensor> wide = widened_or_added(g)) return {*std::move(wide)};
    }
#endif
    return {g.to(input_dtype)};
  }

 protected:
  std::vector<SavedVariable*> saved() override { return {}; }

 private:
#ifdef FASTLAYERS_WITH_CUDA
  std::optional<at::Tensor> widened_or_added(const at::Tensor& g);
#endif
};

#ifdef FASTLAYERS_WITH_CUDA
// In-place additions into the engine's sum. The engine adds the gradients reaching one input of
// a node (an edge) in its input buffer, under the graph task's lock, on the worker thread of the
// node that produced each (a node runs on its device's one thread). Where every node of the graph
// task with that edge is a use of ours on the consumer's stream, every addition into the buffer
// is made on this device's thread, one node at a time, on that stream: a use there may then test
// that the buffer still holds the float32 tensor the last use handed it, and alone (the engine
// otherwise adds into it in place, or replaces it by a new sum and frees ours), and add its
// gradient into it: the engine's own next addition, in its order and bits. It then hands the
// engine nothing. A feeder that is not ours keeps the engine's own additions, wherever it runs.
// The graph root is not among the task's nodes (the engine lists the nodes below it): it runs,
// and adds all it hands, before any other node. The distributed engine lists no nodes (nothing
// is taken there: it runs one graph task on several threads).
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using EdgeKey = std::pair<const torch::autograd::Node*, uint32_t>;

struct EdgeKeyHash {
  size_t operator()(const EdgeKey& k) const {
    return std::hash<const void*>()(k.first) * 31 + k.second;
  }
};

struct HandedGradient {
  WeakTensor sum;      // the float32 gradient last handed the engine for the edge
  c10::Stream stream;  // the stream it was written on
};

// One graph task's view, on one worker thread.
struct EngineSums {
  int task = -1;
  uint64_t last_used = 0;
  bool scanned = false;
  std::unordered_map<EdgeKey, bool, EdgeKeyHash> only_uses;  // edge -> every feeder is ours
  std::unordered_map<EdgeKey, HandedGradient, EdgeKeyHash> handed;

  // This thread's view of `task`: a few tasks' views are kept, since a device's thread
  // interleaves the nodes of concurrent backwards and of reentrant ones (a checkpoint's);
  // a task not seen lately takes the least recently used one's place, emptied.
  static EngineSums& current(int task) {
    constexpr size_t kTasks = 4;
    thread_local std::array<EngineSums, kTasks> views;
    thread_local uint64_t clock = 0;
    EngineSums* oldest = &views[0];
    for (EngineSums& v : views) {
      if (v.task == task) {
        v.last_used = ++clock;
        return v;
      }
      if (v.last_used < oldest->last_used) oldest = &v;
    }
    oldest->task = task;
    oldest->last_used = ++clock;
    oldest->scanned = false;
    oldest->only_uses.clear();
    oldest->handed.clear();
    return *oldest;
  }

  // Whether every node of the graph task with an edge into `key` is a use of ours on the
  // consumer's stream: one scan of the task's nodes, the first time a use finds a gradient
  // handed for its edge.
  bool fed_by_uses_only(const EdgeKey& key) {
    if (!scanned) {
      scanned = true;
      const std::unordered_set<torch::autograd::Node*>* nodes =
          torch::autograd::get_current_graph_task_nodes_in_graph();
      if (nodes == nullptr) return false;
      for (const bool ours : {true, false}) {  // our uses' edges first, then who else feeds them
        for (torch::autograd::Node* node : *nodes) {
          if ((typeid(*node) == typeid(ConvertedUseBackward)) != ours) continue;
          for (const torch::autograd::Edge& edge : node->next_edges()) {
            if (!edge.is_valid()) continue;
            const EdgeKey k{edge.function.get(), edge.input_nr};
            if (ours) {
              const bool same_stream = node->stream() == edge.function->stream();
              auto [it, added] = only_uses.emplace(k, same_stream);
              if (!added) it->second = it->second && same_stream;
            } else if (auto it = only_uses.find(k); it != only_uses.end()) {
              it->second = false;
            }
          }
        }
      }
    }
    const auto it = only_uses.find(key);
    return it != only_uses.end() && it->second;
  }
};

// The engine's buffer for `key`, where it is the gradient handed on `stream` and nothing else
// holds it; undefined otherwise.
at::Tensor engine_sum(EngineSums& sums, const EdgeKey& key, const c10::Stream& stream) {
  const auto it = sums.handed.find(key);
  if (it == sums.handed.end() || it->second.stream != stream || !sums.fed_by_uses_only(key))
    return at::Tensor();
  c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl = it->second.sum.lock();
  if (!impl || impl.use_count() != 2) return at::Tensor();  // the buffer's reference and ours
  at::Tensor sum(std::move(impl));
  if (sum.storage().use_count() != 1) return at::Tensor();  // no view of it either
  return sum;
}

std::optional<at::Tensor> ConvertedUseBackward::widened_or_added(const at::Tensor& g) {
  const torch::autograd::Edge& edge = next_edge(0);
  const int task = torch::autograd::get_current_graph_task_id();  // -1: not in a backward
  const std::optional<c10::Stream> stream = widening_stream(g);  // none while capturing
  // Hand the engine a gradient (as autocast's node) where: this is not the engine evaluating
  // this node (a hook or a Function calling it directly); a post hook of this node must see
  // its output; anomaly mode checks every node's output for NaN.
  const bool engine_evaluates_this = torch::autograd::get_current_node().get() == this;
  if (!stream || !edge.is_valid() || task < 0 || !engine_evaluates_this || !post_hooks().empty() ||
      torch::autograd::AnomalyMode::is_enabled())
    return widen_to_float(g);
  // one stream for the sum's writer, this addition and the consumer: the engine orders a
  // buffer's producers before its consumer where it adds them, not an addition made later
  if (edge.function->stream() != stream) return widen_to_float(g);
  EngineSums& sums = EngineSums::current(task);
  const EdgeKey key{edge.function.get(), edge.input_nr};
  if (at::Tensor sum = engine_sum(sums, key, *stream); sum.defined() && add_widened(sum, g))
    return at::Tensor();
  std::optional<at::Tensor> wide = widen_to_float(g);
  if (wide) sums.handed.insert_or_assign(key, HandedGradient{WeakTensor(wide->getIntrusivePtr()),
                                                             *stream});
  return wide;
}
#endif

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
