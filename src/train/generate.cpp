#include "fsdpp/train/generate.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <fmt/format.h>

#include <cmath>

#include <limits>

#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train {

std::string generate(models::MoETransformerImpl& model, const Tokenizer& tokenizer, const std::string& prompt,
                     const SampleOptions& o) {
  if (!std::isfinite(o.temperature) || o.temperature < 0)
    throw std::invalid_argument(fmt::format(
        "generate: temperature must be 0 (greedy) or positive and finite, got {}", o.temperature));
  if (tokenizer.vocab_size() != model.config().vocab_size)
    throw std::invalid_argument(fmt::format("generate: tokenizer {} has a vocabulary of {} but the model {}",
                                            tokenizer.spec(), tokenizer.vocab_size(),
                                            model.config().vocab_size));
  at::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(o.seed);
  std::vector<int64_t> tokens;
  for (const auto t : tokenizer.encode(prompt)) tokens.push_back(t);
  if (tokens.empty())
    tokens.push_back(tokenizer.eot() >= 0 ? tokenizer.eot() : tokenizer.encode("\n").front());
  std::vector<int32_t> out;
  const int64_t window = model.config().max_seq_len;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t n = std::min<int64_t>(window, static_cast<int64_t>(tokens.size()));
    const auto x = at::tensor(std::vector<int64_t>(tokens.end() - n, tokens.end()), at::kLong).unsqueeze(0);
    auto logits = model.forward(x).select(1, n - 1).squeeze(0);
    int64_t next;
    if (o.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      // In float64 and from the largest logit down: however small the temperature, the scaled
      // logits are at most 0, so nothing overflows to infinity (a tiny temperature gives greedy).
      logits = (logits.to(at::kDouble) - logits.max().to(at::kDouble)) / o.temperature;
      if (o.top_k > 0 && o.top_k < logits.size(0)) {
        const auto kth = std::get<0>(at::topk(logits, o.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = at::multinomial(at::softmax(logits, -1), 1, false, gen).item<int64_t>();
    }
    if (next == tokenizer.eot()) break;
    tokens.push_back(next);
    out.push_back(static_cast<int32_t>(next));
  }
  return tokenizer.decode(out);
}

}  // namespace fsdpp::train
