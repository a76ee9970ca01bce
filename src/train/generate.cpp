#include "fsdpp/train/generate.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "fsdpp/models/kv_cache.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train {

namespace {

// The next token from the last position's logits [vocab]: greedy, or sampled at the temperature
// among the top_k likeliest and the smallest set of them whose probability reaches top_p.
int64_t pick(at::Tensor logits, const SampleOptions& o, at::Generator& gen) {
  if (o.temperature <= 0) return logits.argmax().item<int64_t>();
  // In float64 and from the largest logit down: however small the temperature, the scaled logits
  // are at most 0, so nothing overflows to infinity (a tiny temperature gives greedy).
  logits = (logits.to(at::kDouble) - logits.max().to(at::kDouble)) / o.temperature;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < logits.size(0)) {
    const auto kth = std::get<0>(at::topk(logits, o.top_k)).min();
    logits = logits.masked_fill(logits < kth, minus_inf);
  }
  if (o.top_p < 1) {
    // Tokens by probability, largest first; one stays when the probability before it (the sum of
    // the larger ones) is still below top_p, so the first always stays.
    const auto [sorted, order] = at::sort(logits, /*dim=*/0, /*descending=*/true);
    const auto probs = at::softmax(sorted, 0);
    const auto before = at::cumsum(probs, 0) - probs;
    logits = logits.index_fill(0, order.masked_select(before >= o.top_p), minus_inf);
  }
  return at::multinomial(at::softmax(logits, -1), 1, false, gen).item<int64_t>();
}

}  // namespace

std::string generate(models::MoETransformerImpl& model, const Tokenizer& tokenizer, const std::string& prompt,
                     const SampleOptions& o) {
  if (!std::isfinite(o.temperature) || o.temperature < 0)
    throw std::invalid_argument(fmt::format(
        "generate: temperature must be 0 (greedy) or positive and finite, got {}", o.temperature));
  if (!(o.top_p > 0 && o.top_p <= 1))
    throw std::invalid_argument(fmt::format("generate: top_p must be in (0, 1], got {}", o.top_p));
  if (!tokenizer.fits_model(model.config().vocab_size))
    throw std::invalid_argument(fmt::format("generate: tokenizer {} has a vocabulary of {} but the model {}",
                                            tokenizer.spec(), tokenizer.vocab_size(),
                                            model.config().vocab_size));
  at::NoGradGuard g;
  at::Generator gen = at::detail::createCPUGenerator(o.seed);
  std::vector<int64_t> tokens;
  for (const auto t : tokenizer.encode(prompt)) tokens.push_back(t);
  if (tokens.empty())
    tokens.push_back(tokenizer.eot() >= 0 ? tokenizer.eot() : tokenizer.encode("\n").front());
  const auto stops = [&](int64_t id) {
    return id == tokenizer.eot() || std::find(o.stop_ids.begin(), o.stop_ids.end(), id) != o.stop_ids.end();
  };
  std::optional<models::KVCache> cache;
  if (o.kv_cache) cache.emplace(model);
  const int64_t window = model.config().max_seq_len;
  std::vector<int32_t> out;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t n = std::min<int64_t>(window, static_cast<int64_t>(tokens.size()));
    at::Tensor logits;
    if (cache && static_cast<int64_t>(tokens.size()) <= window) {
      // The tokens the cache lacks: the prompt first, then one at a time.
      const std::vector<int64_t> fresh(tokens.begin() + cache->size(), tokens.end());
      logits = cache->forward(at::tensor(fresh, at::kLong).unsqueeze(0));
      logits = logits.select(1, logits.size(1) - 1).squeeze(0);
    } else {
      // Past max_seq_len the window slides: its last tokens again from their first position.
      const auto x = at::tensor(std::vector<int64_t>(tokens.end() - n, tokens.end()), at::kLong).unsqueeze(0);
      logits = model.forward(x).select(1, n - 1).squeeze(0);
    }
    const int64_t next = pick(logits, o, gen);
    if (stops(next)) break;
    tokens.push_back(next);
    out.push_back(static_cast<int32_t>(next));
  }
  return tokenizer.decode(out);
}

}  // namespace fsdpp::train
