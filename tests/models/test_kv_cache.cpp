// models::KVCache against the whole-sequence forward it stands in for, and train::generate using it.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>

#include "fsdpp/models/kv_cache.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/generate.hpp"
#include "fsdpp/train/tokenizer.hpp"

using namespace fsdpp;

namespace {

models::MoEConfig cache_config(int64_t kv_heads, int64_t experts) {
  models::MoEConfig c;
  c.vocab_size = 64;
  c.dim = 32;
  c.heads = 4;
  c.kv_heads = kv_heads;
  c.layers = 3;
  c.max_seq_len = 24;
  c.ffn_hidden = 40;
  c.experts = experts;
  c.top_k = 2;
  c.expert_hidden = 16;
  c.rope_theta = 500.0;  // angles that turn within 24 positions, so a wrong offset shows
  return c;
}

}  // namespace

TEST_CASE("KVCache: a prompt, then one token at a time, gives the whole-sequence forward's logits") {
  at::NoGradGuard no_grad;
  for (const auto& [kv, experts] :
       {std::pair{0L, 0L}, std::pair{2L, 0L}, std::pair{2L, 4L}, std::pair{1L, 4L}}) {
    CAPTURE(kv);
    CAPTURE(experts);
    at::manual_seed(7);
    models::MoETransformerImpl model(cache_config(kv, experts));
    const auto tokens = at::randint(0, 64, {2, 24}, at::kLong);
    const auto whole = model.forward(tokens);  // [2, 24, 64]
    models::KVCache cache(model, /*batch=*/2);
    std::vector<at::Tensor> parts{cache.forward(tokens.narrow(1, 0, 7))};
    for (int64_t i = 7; i < 24; ++i) parts.push_back(cache.forward(tokens.narrow(1, i, 1)));
    CHECK(cache.size() == 24);
    const auto cached = at::cat(parts, 1);
    const double diff = (cached - whole).abs().max().item<double>();
    CHECK(diff < 2e-5);
    CHECK(whole.abs().max().item<double>() > 0.1);
    // Full: one more position is refused by name.
    try {
      cache.forward(tokens.narrow(1, 0, 1));
      FAIL("a token past max_seq_len was taken");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("max_seq_len 24") != std::string::npos);
    }
    cache.clear();
    const double again = (cache.forward(tokens) - whole).abs().max().item<double>();
    CHECK(again < 2e-5);
  }
}

TEST_CASE("generate feeds each token through the model once with the KV cache, the whole window without") {
  // The router counts the token-expert pairs it routes: with the cache each position is routed
  // once (the prompt, then each new token but the last); without it every step routes the window.
  at::NoGradGuard no_grad;
  at::manual_seed(3);
  auto c = cache_config(2, 4);
  c.vocab_size = 256;
  models::MoETransformerImpl model(c);
  const auto tokenizer = train::Tokenizer::load("bytes");
  const int64_t prompt = 8, fresh = 6, routed_per_token = c.top_k * c.layers;
  for (const bool cached : {true, false}) {
    CAPTURE(cached);
    train::SampleOptions o;
    o.temperature = 0;
    o.max_new_tokens = fresh;
    o.kv_cache = cached;
    model.router_stats().reset();
    train::generate(model, *tokenizer, "abcdefgh", o);
    const double routed = model.router_stats().sums[3].item<double>();
    int64_t expected = (prompt + fresh - 1) * routed_per_token;
    if (!cached) {
      expected = 0;
      for (int64_t i = 0; i < fresh; ++i) expected += (prompt + i) * routed_per_token;
    }
    CHECK(routed == double(expected));
  }
}
