#pragma once
// A wrapper module that takes another's place in a model (fsdp::FullyShard, train::Checkpoint)
// adopts the wrapped module's own parameters, buffers and children under their own names, so that
// named_parameters() and state dicts read as for the unwrapped model.

#include <torch/nn/module.h>

namespace fsdpp {

inline void adopt_members(torch::nn::Module& wrapper, torch::nn::Module& inner) {
  for (auto& p : inner.named_parameters(/*recurse=*/false))
    wrapper.register_parameter(p.key(), p.value(), p.value().requires_grad());
  for (auto& b : inner.named_buffers(/*recurse=*/false)) wrapper.register_buffer(b.key(), b.value());
  for (auto& c : inner.named_children()) wrapper.register_module(c.key(), c.value());
}

}  // namespace fsdpp
