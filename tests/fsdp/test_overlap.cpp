// Overlap and prefetch, checked by order rather than by results or timing: a log on each rank takes
// every all-gather and reduce-scatter as fully_shard issues it (with the unit it is for) and the
// model's own compute events, so a regression that serialises communication behind compute fails
// here even though every result would stay the same.
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <mutex>

#include "fsdp/event_log.hpp"
#include "fsdp/models.hpp"

using namespace fsdpp;
using test::EventLog;
using test::LoggingComm;

namespace {

// Identity whose backward logs that the gradient of the block's input is computed: the block's
// backward compute is done.
struct BackwardDone : torch::autograd::Function<BackwardDone> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, int64_t block, int64_t log) {
    ctx->saved_data["block"] = block;
    ctx->saved_data["log"] = log;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    auto* log = reinterpret_cast<EventLog*>(ctx->saved_data["log"].toInt());
    log->add("bwd_done " + std::to_string(ctx->saved_data["block"].toInt()));
    return {g[0], at::Tensor(), at::Tensor()};
  }
};

struct LoggedBlockImpl : torch::nn::Module {
  LoggedBlockImpl(int64_t d, int index, EventLog& log) : index(index), log(&log) {
    fc = register_module("fc", torch::nn::Linear(d, d));
  }
  at::Tensor forward(at::Tensor x) {
    x = BackwardDone::apply(x, index, reinterpret_cast<int64_t>(log));
    auto y = at::tanh(fc(x)) + x;
    log->add("fwd_end " + std::to_string(index));
    return y;
  }
  int index;
  EventLog* log;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(LoggedBlock);

struct LoggedNetImpl : torch::nn::Module {
  LoggedNetImpl(int64_t d, int layers, EventLog& log) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < layers; ++i) blocks->push_back(fsdp::FullyShard<LoggedBlock>(LoggedBlock(d, i, log)));
    head = register_module("head", torch::nn::Linear(d, 1));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : *blocks) x = b->as<fsdp::FullyShardImpl<LoggedBlock>>()->forward(x);
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(LoggedNet);

}  // namespace

TEST_CASE("overlap by order: gathers run ahead of compute, each reduce-scatter is issued before the next block's backward ends") {
  constexpr int kLayers = 4;
  for (bool overlap : {true, false})
    test::run_ranks(2, [&](comm::Comm& world) {
      EventLog log;
      comm::Comm comm(std::make_shared<LoggingComm>(world.impl_ptr(), log));
      comm.set_consistency_check(false);
      fsdp::FullyShardOptions o;
      o.overlap_reduce_scatter = overlap;
      auto model = fsdp::fully_shard(LoggedNet(8, kLayers, log), comm, o);
      auto x = at::randn({4, 8}).requires_grad_(true);  // so that block 0 has a backward too
      model->forward(x).sum().backward();  // the first step records the forward order
      {
        std::lock_guard<std::mutex> lock(log.mu);
        log.events.clear();
      }
      model->forward(x).sum().backward();
      INFO("overlap=" << overlap << " rank " << comm.rank() << ": " << log.dump());
      auto block = [](int i) { return "blocks." + std::to_string(i); };
      for (int i = 0; i + 1 < kLayers; ++i) {
        // Forward prefetch: block i+1's all-gather goes out while block i computes.
        const long gather = log.find("AG " + block(i + 1));
        CHECK(gather >= 0);
        CHECK(gather < log.find("fwd_end " + std::to_string(i)));
      }
      for (int i = kLayers - 1; i >= 1; --i) {
        // Backward prefetch: block i-1's second all-gather (its backward one) goes out before
        // block i's backward compute is done.
        const long gather = log.find("AG " + block(i - 1), 1);
        CHECK(gather >= 0);
        CHECK(gather < log.find("bwd_done " + std::to_string(i)));
        // Block i's reduce-scatter is issued as soon as its gradients exist: before block i-1's
        // backward compute ends, not after the whole backward.
        const long reduce = log.find("RS " + block(i));
        CHECK(reduce > log.find("bwd_done " + std::to_string(i)));
        CHECK(reduce < log.find("bwd_done " + std::to_string(i - 1)));
      }
    });
}
