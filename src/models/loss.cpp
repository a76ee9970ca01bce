// The language-modelling losses (models/moe.hpp): next-token cross entropy over the vocabulary.
#include <ATen/ATen.h>

#include "fsdpp/models/moe.hpp"

namespace fsdpp::models {

at::Tensor summed_lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  const auto V = logits.size(-1);
  return at::nll_loss(at::log_softmax(logits.reshape({-1, V}).to(at::kFloat), -1), targets.reshape(-1), {},
                      at::Reduction::Sum, -100);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  const auto V = logits.size(-1);
  return at::nll_loss(at::log_softmax(logits.reshape({-1, V}).to(at::kFloat), -1), targets.reshape(-1));
}

}  // namespace fsdpp::models
