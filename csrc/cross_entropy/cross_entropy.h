// Cross-entropy rows, in place: one pass reads a chunk of logits rows and gives each row's loss
// (float32); with `grad`, a second pass overwrites the row with its gradient, rounded to the
// logits' dtype at the points native's autograd chain rounds (see cross_entropy.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace fastlayers {

// The per-element arithmetic shared by the CPU loop and the CUDA kernel (host and device).
// T: the logits' dtype (float, at::Half, at::BFloat16); rounding to T is a cast through T.
template <typename T>
struct CrossEntropyMath {
  // the logit as the loss sees it: Gemma's soft-cap in T's rounding (divide, tanh, multiply),
  // then float; `capped` receives tanh's rounded output (the cap's backward needs it)
  static inline C10_HOST_DEVICE float logit(T x, float cap, float* capped) {
    if (cap == 0.0f) return static_cast<float>(x);
    const float y = static_cast<float>(static_cast<T>(static_cast<float>(x) / cap));
    const float th = static_cast<float>(static_cast<T>(::tanhf(y)));
    *capped = th;
    return static_cast<float>(static_cast<T>(th * cap));
  }
  // d loss / d logit in T: (softmax - onehot) / normaliser rounded to T (the float32 upcast's
  // backward), then back through the cap: times cap, tanh's backward, divided by cap, each in T.
  // The softmax as exp((z - max) - log(sum)), as log_softmax's backward takes it: z - max is
  // exact near the top and log(sum) small, where exp(z - (max + log(sum))) would round the
  // larger max + log(sum) first.
  static inline C10_HOST_DEVICE T grad(float z, float max, float log_sum, bool is_target,
                                       float normaliser, float cap, float capped) {
    float g = ::expf((z - max) - log_sum) - (is_target ? 1.0f : 0.0f);
    T out = static_cast<T>(g / normaliser);
    if (cap != 0.0f) {
      const float a = static_cast<float>(static_cast<T>(static_cast<float>(out) * cap));
      const float b = static_cast<float>(static_cast<T>(a * (1.0f - capped * capped)));
      out = static_cast<T>(b / cap);
    }
    return out;
  }
};

at::Tensor cross_entropy_rows_cuda(at::Tensor& logits, const at::Tensor& target,
                                   const at::Tensor& normaliser, double softcap, bool grad);

}  // namespace fastlayers
