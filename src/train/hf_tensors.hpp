#pragma once
// The tensors of transformers' checkpoints and fsdpp's parameters, name for name, for every family
// train/hf.hpp reads and writes (src/train/hf_tensors.cpp).
#include <string>
#include <vector>

#include "fsdpp/models/config.hpp"
#include "fsdpp/train/hf.hpp"
#include "fsdpp/train/lazy_tensor.hpp"

namespace fsdpp::train::hf::detail {

// fsdpp's full parameters as transformers names them, before conversion: views of `state`'s (rows
// of the fused projection, one expert of the stacked ones), checked against the config.
NamedTensors to_hf_views(const models::MoEConfig& c, const NamedTensors& state);

// Every tensor a checkpoint of config `c` must hold, and none other, checked now
// (std::invalid_argument naming `source` and the tensor when one is missing, left over or of
// another shape) and made later.
std::vector<LazyTensor> from_hf_lazy(const models::MoEConfig& c, const NamedTensors& hf,
                                     const std::string& source);

}  // namespace fsdpp::train::hf::detail
