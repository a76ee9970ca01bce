// Greedy generation with and without the KV cache (train::generate, models::KVCache): a random dense
// model of a given shape, prompts of random bytes; per prompt length the time of the first new token
// (the prompt's forward) and of each token after it, each the fastest of 3 calls. One line per
// measurement:
//   RESULT generate prompt=<L> cache=<0|1> first_ms=<..> per_token_ms=<..>
//   fsdpp_generate_bench [--dim 256] [--layers 4] [--heads 8] [--kv-heads 2] [--ffn 704] [--new 32]
//                        [--cache 1] [--prompt 16]
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/generate.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "options.hpp"

using namespace fsdpp;

int main(int argc, char** argv) {
  int64_t dim = 256, layers = 4, heads = 8, kv_heads = 2, ffn = 704, fresh = 32, cache = 1, prompt = 16;
  if (!bench::parse_options(argc, argv, "fsdpp_generate_bench",
                            {{"dim", &dim},
                             {"layers", &layers},
                             {"heads", &heads},
                             {"kv-heads", &kv_heads},
                             {"ffn", &ffn},
                             {"new", &fresh},
                             {"cache", &cache},
                             {"prompt", &prompt}}))
    return 2;
  models::MoEConfig c;
  c.vocab_size = 256, c.dim = dim, c.layers = layers, c.heads = heads, c.kv_heads = kv_heads;
  c.ffn_hidden = ffn, c.experts = 0, c.max_seq_len = prompt + fresh + 1;
  at::manual_seed(0);
  models::MoETransformerImpl model(c);
  const auto tokenizer = train::Tokenizer::load("bytes");
  std::mt19937 rng(1);
  std::string text(static_cast<size_t>(prompt), ' ');
  for (auto& ch : text) ch = static_cast<char>('a' + rng() % 26);
  train::SampleOptions o;
  o.temperature = 0;
  o.kv_cache = cache != 0;
  // The fastest of 3 calls: the per-token figure is a difference of two times, which one slow call
  // would swamp.
  const auto timed = [&](int64_t n) {
    o.max_new_tokens = n;
    double best = 1e300;
    for (int k = 0; k < 3; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      train::generate(model, *tokenizer, text, o);
      best = std::min(
          best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  timed(1);  // warm-up: kernels chosen, buffers allocated
  const double first = timed(1), all = timed(fresh + 1);
  fmt::print("RESULT generate prompt={} cache={} first_ms={:.3f} per_token_ms={:.4f}\n", prompt, cache, first,
             (all - first) / double(fresh));
}
