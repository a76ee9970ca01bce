#include "fsdpp/train/memory_estimate.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/train/recipe.hpp"

namespace fsdpp::train {

namespace {

constexpr double kGiB = double(1 << 30);

double bytes_of(at::ScalarType t) { return t == at::kFloat ? 4.0 : 2.0; }

}  // namespace

std::string MemoryEstimate::describe() const {
  std::vector<std::pair<std::string, double>> parts = {
      {"sharded parameters", parameters}, {"their gradients", gradients},
      {"AdamW state", optimizer},         {"gathered parameters and gradients", gathered},
      {"activations", activations},       {"logits", logits},
      {"LibTorch and buffers", overhead}};
  std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<std::string> text;
  for (const auto& [name, b] : parts)
    if (b >= 0.005 * kGiB) text.push_back(fmt::format("{} {:.2f} GiB", name, b / kGiB));
  return fmt::format("{:.2f} GiB per rank ({})", total() / kGiB, fmt::join(text, ", "));
}

MemoryEstimate estimate_memory(const Recipe& r) {
  const auto& c = r.model;
  const auto& par = r.parallel;
  MemoryEstimate m;
  const double d = double(c.dim), L = double(c.layers), stages = double(par.pp);
  const double embed = (c.tie_embeddings ? 1.0 : 2.0) * double(c.vocab_size) * d;  // embedding and head
  const double total = double(c.parameter_count());
  const double block = (total - embed) / std::max(1.0, L);
  const double stage = total / stages;  // this rank's stage (the pp ranks share the model)
  const double shard = stage / double(par.dp_shard());
  m.parameters = 4 * shard;
  m.gradients = 4 * shard;
  m.optimizer = 8 * shard;
  const double pbytes = bytes_of(r.precision.param_dtype), gbytes = 4;
  // Blocks that reshard after forward are gathered one (and the next, prefetched) at a time.
  const bool one_block = par.pp == 1 && par.reshard_after_forward && r.cpu.microbatch_threads == 1;
  m.gathered = (one_block ? std::min(stage, 2 * block + embed) : stage) * (pbytes + gbytes);
  // Per token and layer: q, k, v, the attention's output and projection, the norms' inputs and the
  // residual stream (about 12 d), the feed-forward's hidden activations (3 h: gate, up, their
  // product) and an MoE layer's dispatch copies (2 d per chosen expert).
  double hidden = double(c.ffn_hidden), dispatch = 0;
  if (c.experts > 0) {
    hidden = double(c.top_k * c.expert_hidden + (c.shared_expert ? c.expert_hidden : 0));
    dispatch = 2.0 * double(c.top_k) * d;
  }
  const double per_token_layer = r.train.activation_checkpointing == 1 ? d : 12 * d + 3 * hidden + dispatch;
  const double tokens = double(r.micro_batch()) * double(r.data.seq_len);
  // Microbatches whose activations are held at once: the pipeline's warm-up depth, or the threads.
  const double in_flight = par.pp > 1 ? double(std::min(par.microbatches, par.pp * par.stages_per_rank))
                                      : double(r.cpu.microbatch_threads);
  const double abytes = bytes_of(r.precision.param_dtype);
  m.activations = in_flight * tokens * (L / stages) * per_token_layer * abytes;
  m.logits = tokens * double(c.vocab_size) * 4 * 3;  // logits, their softmax and its gradient, float32
  m.overhead = 0.5 * kGiB;
  return m;
}

std::optional<double> memory_per_rank(const Recipe& r, int local_ranks, std::string* what) {
  if (r.train.device == Device::kCuda) {
    std::string why;
    if (comm::cuda_device_count(&why) == 0) {
      if (what) *what = fmt::format("no GPU here to compare with ({})", why);
      return std::nullopt;
    }
    const double bytes = comm::cuda_device_memory(0);
    if (what) *what = fmt::format("{:.1f} GiB on GPU 0", bytes / kGiB);
    return bytes;
  }
  std::ifstream f("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (f >> key >> kib) {
    if (key == "MemTotal:") {
      const double bytes = kib * 1024 / std::max(1, local_ranks);
      if (what)
        *what = fmt::format("this machine has {:.1f} GiB{}", kib * 1024 / kGiB,
                            local_ranks > 1
                                ? fmt::format(", {:.1f} GiB for each of {} ranks", bytes / kGiB, local_ranks)
                                : "");
      return bytes;
    }
    f.ignore(1 << 10, '\n');
  }
  if (what) *what = "the machine's memory is unknown (no MemTotal in /proc/meminfo)";
  return std::nullopt;
}

std::string check_memory(const Recipe& r, int local_ranks) {
  const auto est = estimate_memory(r);
  std::string machine;
  const auto have = memory_per_rank(r, local_ranks, &machine);
  if (have && est.total() > *have)
    throw std::invalid_argument(
        fmt::format("{}: this recipe cannot fit: it needs an estimated {}, and {}. Make it fit: a smaller "
                    "model, a smaller "
                    "train.global_batch or more train.grad_accum, more ranks (parallel.dp shards the "
                    "parameters and optimizer "
                    "state, parallel.pp the layers), or train.activation_checkpointing",
                    r.source, est.describe(), machine));
  return fmt::format("memory: an estimated {}; {}", est.describe(),
                     have ? machine : "not compared: " + machine);
}

}  // namespace fsdpp::train
