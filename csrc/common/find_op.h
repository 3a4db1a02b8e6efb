// Typed handles of fastlayers' registered ops, for C++ that calls an op through the dispatcher
// (autograd nodes, the eager entry points), so that it gets the op's autograd, autocast and
// device dispatch.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace fastlayers {

// The op `name` ("fastlayers::layer_norm_fwd") with signature Sig. Look it up once per op:
// `static const auto op = find_op<Sig>("fastlayers::...");`.
template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace fastlayers
