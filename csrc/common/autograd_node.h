// The autograd node of a fused op, written as torch's code generator writes the nodes of its
// own ops: the graph edges, the saved tensors and a backward, and nothing else.
// torch::autograd::Function adds per call a context object, input metadata for every argument,
// a pass over the outputs for views, in-place and non-differentiable marks, and a saved-variable
// list; measured on CPU, LayerNorm's training-mode forward cost 8.6 us through it against 4.0 us
// for torch.layer_norm (fastlayers' host-cost benchmark, benchmarks/bench_host.py).
//
// Works across the torch versions fastlayers supports: nodes are held by std::shared_ptr up to
// torch 2.12 and by c10::intrusive_ptr from 2.13 on; NodePtr is whichever Node::getptr returns.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace fastlayers {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());

// A new node of type T (default-constructed), held as torch holds nodes.
template <typename T>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    // deleteNode (found by argument-dependent lookup: it exists only where nodes are
    // shared_ptrs) frees long chains of nodes without deep recursion, as torch's own nodes do
    return std::shared_ptr<T>(new T(), [](T* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<T>();
  }
}

inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const std::optional<at::Tensor>& t) {
  return t.has_value() && requires_grad(*t);
}

// Whether a call records a node: grad mode on and some differentiable input requiring grad.
template <typename... Tensors>
bool records_grad(const Tensors&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

// The base of fastlayers' nodes: `name` for graph printing and errors, the saved tensors freed
// when the graph is (release_variables), and the double-backward refusal every op shares.
class FusedNode : public torch::autograd::Node {
 public:
  std::string name() const override = 0;

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : saved()) v->reset_data();
  }

 protected:
  // The node's saved tensors (release_variables frees them).
  virtual std::vector<SavedVariable*> saved() = 0;

  // Refuses create_graph=True: the fused backward is not itself differentiable.
  void refuse_double_backward(const char* op, const char* instead) const {
    TORCH_CHECK(!at::GradMode::is_enabled(), op,
                ": double backward (create_graph=True) is not supported; use ", instead,
                " where second derivatives are needed");
  }

  at::Tensor unpack(const SavedVariable& v) { return v.unpack(getptr()); }
  std::optional<at::Tensor> unpack_optional(const SavedVariable& v) {
    at::Tensor t = unpack(v);
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  }
};

}  // namespace fastlayers
