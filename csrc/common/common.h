// Shared host-side helpers for every op family: argument checks that name the
// argument, and dtype dispatch over the dtypes fastlayers supports.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <string>
#include <utility>

namespace fastlayers {

template <typename T>
struct TypeTag {
  using type = T;
};

inline bool is_supported_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

// Calls f(TypeTag<T>{}) with T the C++ type of `st` (float, c10::Half or c10::BFloat16): the
// dtypes of the tuned kernels, which accumulate in float. float64 is refused here; code that
// takes it too (in double arithmetic, at::opmath_type<T>) uses dispatch_dtype_f64.
template <typename F>
void dispatch_dtype(at::ScalarType st, const char* what, F&& f) {
  switch (st) {
    case at::kFloat:
      f(TypeTag<float>{});
      break;
    case at::kHalf:
      f(TypeTag<c10::Half>{});
      break;
    case at::kBFloat16:
      f(TypeTag<c10::BFloat16>{});
      break;
    default:
      TORCH_CHECK(false, what, ": unsupported dtype ", st);
  }
}

// dispatch_dtype plus float64 (T = double).
template <typename F>
void dispatch_dtype_f64(at::ScalarType st, const char* what, F&& f) {
  if (st == at::kDouble) {
    f(TypeTag<double>{});
  } else {
    dispatch_dtype(st, what, std::forward<F>(f));
  }
}

// The floating input of an op: float32, float64, float16 or bfloat16, with a message naming it.
inline void check_input_dtype(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), op, ": ", arg,
              " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                              const char* arg, const char* ref_arg) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", arg, " is on ", t.device().str(), " but ", ref_arg,
              " is on ", ref.device().str(), "; move them to the same device");
}

// A parameter's dtype may equal the input's, or be float32 (fp32 master weights under
// half/bf16 activations), as torch.nn.functional accepts; a float64 input takes float64
// parameters only (native layer_norm refuses float32 ones: "mixed dtype").
inline void check_param_dtype(const at::Tensor& p, const at::Tensor& input, const char* op,
                              const char* arg) {
  const at::ScalarType in = input.scalar_type();
  if (in == at::kDouble) {
    TORCH_CHECK(p.scalar_type() == in, op, ": ", arg, " has dtype ", p.scalar_type(),
                " but input has dtype ", in, "; a float64 input needs float64 parameters");
    return;
  }
  TORCH_CHECK(p.scalar_type() == in || p.scalar_type() == at::kFloat, op, ": ", arg,
              " has dtype ", p.scalar_type(), " but input has dtype ", in, "; ", arg,
              " must have the input's dtype or float32");
}

// "[2, 3]". Built with std::to_string, not std::ostream: streaming integers through an ostream
// compiled into the extension crashed (in libstdc++'s num_put) where the process had loaded
// another libstdc++; error messages must never crash.
inline std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace fastlayers
