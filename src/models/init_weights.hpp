#pragma once
// How the model's modules draw their initial weights (src/models/moe.cpp, src/models/attention.cpp).
#include <ATen/core/Tensor.h>

namespace fsdpp::models::detail {

// Set on this thread while a model is built with Weights::kUnallocated: its weights will be
// loaded, so drawing them would only cost time (most of a large model's build).
extern thread_local bool building_unallocated;

// w ~ N(0, std) in place, unless building_unallocated.
void init_normal(at::Tensor& w, double std);

}  // namespace fsdpp::models::detail
