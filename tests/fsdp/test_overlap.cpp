// Overlap and prefetch, checked by order and observed with slowed communication: a log on each rank takes
// every all-gather and reduce-scatter as fully_shard issues it (with the unit it is for) and the
// model's own compute events, so a regression that serialises communication behind compute fails
// here even though every result would stay the same.
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <variant>

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
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
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
    for (size_t i = 0; i < blocks->size(); ++i)
      x = blocks[reversed ? blocks->size() - 1 - i : i]->as<fsdp::FullyShardImpl<LoggedBlock>>()->forward(x);
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
  bool reversed = false;  // run the blocks last to first
};
TORCH_MODULE(LoggedNet);

// Two steps on `x`, the log keeping the second's events only: the first records the forward order
// that prefetching follows.
template <class Model>
void second_step(Model& model, const at::Tensor& x, EventLog& log) {
  model->forward(x).sum().backward();
  log.clear();
  model->forward(x).sum().backward();
}

}  // namespace

TEST_CASE(
    "overlap by order: gathers run ahead of compute, each reduce-scatter is issued before the next block's "
    "backward ends") {
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
      second_step(model, x, log);
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

// The overlap itself rather than the order of issue: with every reduce-scatter slowed by 100 ms,
// the next block's backward must finish while the previous block's reduce-scatter is still in
// flight. The serialized variant (overlap_reduce_scatter = false: wait for each at once) runs the
// same check and must show no overlap at all, which is what makes the check worth its name.
TEST_CASE(
    "overlap observed: backward computes while a slowed reduce-scatter is in flight; serialized, never") {
  constexpr int kLayers = 4;
  std::map<bool, int>
      overlapped;  // by variant: blocks whose reduce-scatter was in flight during the next's backward
  std::mutex mu;
  for (bool overlap : {true, false})
    test::run_ranks(2, [&](comm::Comm& world) {
      EventLog log;
      comm::Comm comm(
          std::make_shared<test::DelayingComm>(world.impl_ptr(), log, std::chrono::milliseconds(100)));
      comm.set_consistency_check(false);
      fsdp::FullyShardOptions o;
      o.overlap_reduce_scatter = overlap;
      auto model = fsdp::fully_shard(LoggedNet(8, kLayers, log), comm, o);
      auto x = at::randn({4, 8}).requires_grad_(true);
      second_step(model, x, log);
      INFO("overlap=" << overlap << " rank " << comm.rank() << ": " << log.dump());
      int n = 0;
      for (int i = kLayers - 1; i >= 1; --i) {
        const long done = log.find("RS_done blocks." + std::to_string(i));
        REQUIRE(done >= 0);
        if (log.find("bwd_done " + std::to_string(i - 1)) < done) ++n;
      }
      std::lock_guard<std::mutex> lock(mu);
      overlapped[overlap] = std::max(overlapped[overlap], n);
    });
  CHECK(overlapped[true] == kLayers - 1);
  CHECK(overlapped[false] == 0);
}

// Note [replica average]: HSDP with shard groups of one rank is data parallelism; each unit's
// all-reduce across the replicas overlaps the backward as a reduce-scatter does, instead of all of
// them going out one after the other once the backward is over.
TEST_CASE(
    "HSDP with shard groups of one rank: each block's all-reduce across replicas is issued before the next "
    "block's backward ends") {
  constexpr int kLayers = 4;
  test::run_ranks(2, [&](comm::Comm& world) {
    EventLog log;
    comm::Comm alone(std::make_shared<LoggingComm>(world.split(world.rank(), 0).impl_ptr(), log));
    comm::Comm replicas(std::make_shared<LoggingComm>(world.split(0, world.rank()).impl_ptr(), log));
    replicas.set_consistency_check(false);
    fsdp::FullyShardOptions o;
    o.replicate = replicas;
    auto model = fsdp::fully_shard(LoggedNet(8, kLayers, log), alone, o);
    auto x = at::randn({4, 8}, at::detail::createCPUGenerator(1)).requires_grad_(true);
    second_step(model, x, log);
    INFO("rank " << world.rank() << ": " << log.dump());
    for (int i = kLayers - 1; i >= 1; --i) {
      const std::string block = "blocks." + std::to_string(i);
      const long reduce = log.find("RS " + block), average = log.find("AR " + block);
      CHECK(reduce > log.find("bwd_done " + std::to_string(i)));
      CHECK(average > reduce);
      CHECK(average < log.find("bwd_done " + std::to_string(i - 1)));
    }
    // Both replicas ended with the same gradients.
    for (const auto& p : model->sharded_parameters()) {
      auto other = p.grad().clone();
      world.broadcast(other, {.root = 0}).wait();
      CHECK(at::equal(p.grad(), other));
    }
  });
}

// An explicit asynchronous unshard issues the gathers in the order the next forward waits for
// them: the root's first, then the blocks in the last forward's order (sharding order before any
// forward).
TEST_CASE("unshard(async) gathers the root first, then in the last forward's order") {
  constexpr int kLayers = 4;
  test::run_ranks(2, [&](comm::Comm& world) {
    EventLog log;
    comm::Comm comm(std::make_shared<LoggingComm>(world.impl_ptr(), log));
    comm.set_consistency_check(false);
    LoggedNet net(8, kLayers, log);
    net->reversed = true;
    auto model = fsdp::fully_shard(net, comm);
    auto gathers = [&] {
      std::lock_guard<std::mutex> lock(log.mu);
      std::vector<std::string> out;
      for (const auto& e : log.events)
        if (e.rfind("AG ", 0) == 0) out.push_back(e.substr(3));
      log.events.clear();
      return out;
    };
    auto block = [](int i) { return "blocks." + std::to_string(i); };
    gathers();
    model->unshard(/*async=*/true);
    model->reshard();
    std::vector<std::string> want = {"root"};
    for (int i = 0; i < kLayers; ++i) want.push_back(block(i));
    CHECK(gathers() == want);

    model->forward(at::randn({4, 8})).sum().backward();  // records blocks 3, 2, 1, 0
    gathers();
    model->unshard(/*async=*/true);
    model->reshard();
    want = {"root"};
    for (int i = kLayers - 1; i >= 0; --i) want.push_back(block(i));
    CHECK(gathers() == want);
    // The forward that follows waits for those gathers and issues none of its own.
    model->unshard(/*async=*/true);
    model->forward(at::randn({4, 8}));
    CHECK(gathers() == want);
  });
}

namespace {

// A block of two inputs: x as LoggedBlock's, and a scale s that needs a gradient too.
struct PairBlockImpl : torch::nn::Module {
  PairBlockImpl(int64_t d, int index, EventLog& log) : index(index), log(&log) {
    fc = register_module("fc", torch::nn::Linear(d, d));
  }
  at::Tensor forward(at::Tensor x, at::Tensor s) {
    x = BackwardDone::apply(x, index, reinterpret_cast<int64_t>(log));
    auto y = at::tanh(fc(x)) * s + x;
    log->add("fwd_end " + std::to_string(index));
    return y;
  }
  int index;
  EventLog* log;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(PairBlock);

// Every way a post-backward is arranged (Note [post-backward hook]): the root takes two leaves, so
// they pass through its identity node; blocks.0 takes the root's alias of x, whose producer is that
// node; blocks.1 takes two inputs, so it has its own node; blocks.2 takes blocks.1's output and
// hooks that block's output node, whose hook then serves both; blocks.4 takes the same tensor, finds
// that hook taken and gets a node; blocks.3 takes a sum, and hooks the sum's node.
struct MixedNetImpl : torch::nn::Module {
  MixedNetImpl(int64_t d, EventLog& log) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    blocks->push_back(fsdp::FullyShard<LoggedBlock>(LoggedBlock(d, 0, log)));
    blocks->push_back(fsdp::FullyShard<PairBlock>(PairBlock(d, 1, log)));
    for (int i = 2; i <= 4; ++i) blocks->push_back(fsdp::FullyShard<LoggedBlock>(LoggedBlock(d, i, log)));
    head = register_module("head", torch::nn::Linear(d, 1));
  }
  at::Tensor forward(at::Tensor x, at::Tensor s) {
    auto single = [&](size_t i, const at::Tensor& h) {
      return blocks[i]->as<fsdp::FullyShardImpl<LoggedBlock>>()->forward(h);
    };
    const auto h1 = blocks[1]->as<fsdp::FullyShardImpl<PairBlock>>()->forward(single(0, x), s);
    return head(single(3, single(2, h1) + single(4, h1)));
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MixedNet);

}  // namespace

// Note [post-backward hook]: whether a block's post-backward comes from a hook on the node that
// produced its input or from an identity node in front of its inputs, its reduce-scatter goes out
// after its own backward compute and before the previous block's ends, and the gradients are the
// unsharded model's.
TEST_CASE(
    "post-backward by hook, and by identity node for a leaf or two inputs: each reduce-scatter between its "
    "block's backward and the previous one's") {
  test::run_ranks(2, [&](comm::Comm& world) {
    EventLog log;
    comm::Comm comm(std::make_shared<LoggingComm>(world.impl_ptr(), log));
    comm.set_consistency_check(false);
    auto plain = MixedNet(8, log);
    auto net = MixedNet(8, log);
    {  // the same weights on every rank
      at::NoGradGuard no_grad;
      auto params = plain->parameters();
      for (size_t i = 0; i < params.size(); ++i)
        params[i].copy_(at::randn(params[i].sizes(), at::detail::createCPUGenerator(100 + i)) * 0.3);
    }
    test::copy_params(*net, *plain);
    auto model = fsdp::fully_shard(net, comm);
    const auto x0 = at::randn({4, 8}, at::detail::createCPUGenerator(5));
    const auto s0 = at::rand({4, 8}, at::detail::createCPUGenerator(6));
    auto x = x0.clone().requires_grad_(true), s = s0.clone().requires_grad_(true);
    model->forward(x, s).sum().backward();  // the first step records the forward order
    log.clear();
    model->forward(x, s).sum().backward();
    INFO("rank " << comm.rank() << ": " << log.dump());
    // Block i's reduce-scatter, after its backward and before that of the block feeding it.
    for (const auto& [i, feeding] :
         std::vector<std::pair<int, int>>{{3, 2}, {3, 4}, {4, 1}, {2, 1}, {1, 0}, {0, -1}}) {
      const long reduce = log.find("RS blocks." + std::to_string(i));
      CHECK(reduce > log.find("bwd_done " + std::to_string(i)));
      if (feeding >= 0) CHECK(reduce < log.find("bwd_done " + std::to_string(feeding)));
    }
    // Two steps' gradients, as the plain model accumulates them; and the inputs' own.
    auto px = x0.clone().requires_grad_(true), ps = s0.clone().requires_grad_(true);
    for (int step = 0; step < 2; ++step) plain->forward(px, ps).sum().backward();
    CHECK(at::allclose(x.grad(), px.grad(), 1e-5, 1e-6));
    CHECK(at::allclose(s.grad(), ps.grad(), 1e-5, 1e-6));
    for (const auto& shard : fsdp::shards(*model.ptr())) {
      const auto full = plain->named_parameters()[shard.name].grad();
      const auto rows = full.narrow(0, shard.info.row_offset, shard.info.local_rows);
      INFO(shard.name);
      CHECK(at::allclose(shard.param.grad(), rows, 1e-5, 1e-6));
    }
  });
}

// Prefetch observed rather than ordered: every all-gather is slowed by 100 ms. Implicitly (one unit
// ahead, from the last forward's order) and explicitly (two ahead), the next block's all-gather is
// in flight while a block computes, in forward and in backward; explicitly, the one after it too.
// Without prefetch (each block's lists name only itself, so nothing further is gathered early) no
// gather is in flight during compute, which is what gives the check its teeth.
TEST_CASE("prefetch observed: implicit and explicit gathers in flight while blocks compute; none without") {
  constexpr int kLayers = 4;
  enum Variant { kImplicit, kExplicit, kNone };
  struct Seen {
    int ahead1 = 0, ahead2 = 0;    // forward: blocks computed while the next (the one after) gathered
    int behind1 = 0, behind2 = 0;  // backward: the previous (the one before it)
  };
  std::map<int, Seen> seen;  // by variant: the most any rank saw
  std::mutex mu;
  for (int variant : {kImplicit, kExplicit, kNone})
    test::run_ranks(2, [&](comm::Comm& world) {
      EventLog log;
      comm::Comm comm(std::make_shared<test::DelayingComm>(
          world.impl_ptr(), log, std::chrono::milliseconds(100), "", test::DelayingComm::kAllGathers));
      comm.set_consistency_check(false);
      auto net = LoggedNet(8, kLayers, log);
      auto model = fsdp::fully_shard(net, comm);
      auto block = [&](int i) -> fsdp::UnitHolder* {
        return i >= 0 && i < kLayers ? net->blocks[i]->as<fsdp::FullyShardImpl<LoggedBlock>>() : nullptr;
      };
      for (int i = 0; i < kLayers; ++i) {
        auto* unit = net->blocks[i]->as<fsdp::FullyShardImpl<LoggedBlock>>();
        std::vector<fsdp::UnitHolder*> ahead, behind;
        for (int k : {1, 2}) {
          if (variant == kExplicit && block(i + k)) ahead.push_back(block(i + k));
          if (variant == kExplicit && block(i - k)) behind.push_back(block(i - k));
        }
        if (variant == kNone) ahead = behind = {block(i)};
        if (variant != kImplicit) {
          unit->set_modules_to_forward_prefetch(ahead);
          unit->set_modules_to_backward_prefetch(behind);
        }
      }
      auto x = at::randn({4, 8}).requires_grad_(true);
      second_step(model, x, log);
      INFO("variant " << variant << " rank " << comm.rank() << ": " << log.dump());
      // Whether block `other`'s n-th gather was issued before `compute` was logged and landed after.
      auto in_flight = [&](int other, int n, const std::string& compute) {
        const std::string unit = "blocks." + std::to_string(other);
        const long at = log.find(compute);
        return log.find("AG " + unit, n) >= 0 && log.find("AG " + unit, n) < at &&
               at < log.find("AG_done " + unit, n);
      };
      Seen s;
      for (int i = 0; i < kLayers; ++i) {
        const auto fwd = "fwd_end " + std::to_string(i), bwd = "bwd_done " + std::to_string(i);
        s.ahead1 += i + 1 < kLayers && in_flight(i + 1, 0, fwd);
        s.ahead2 += i + 2 < kLayers && in_flight(i + 2, 0, fwd);
        s.behind1 += i >= 1 && in_flight(i - 1, 1, bwd);
        s.behind2 += i >= 2 && in_flight(i - 2, 1, bwd);
      }
      std::lock_guard<std::mutex> lock(mu);
      auto& m = seen[variant];
      m = {std::max(m.ahead1, s.ahead1), std::max(m.ahead2, s.ahead2), std::max(m.behind1, s.behind1),
           std::max(m.behind2, s.behind2)};
    });
  // One ahead is all the implicit prefetch does.
  CHECK(seen[kImplicit].ahead1 == kLayers - 1);
  CHECK(seen[kImplicit].behind1 == kLayers - 1);
  CHECK(seen[kImplicit].ahead2 == 0);
  CHECK(seen[kImplicit].behind2 == 0);
  // Two ahead explicitly. (One ahead is not checked here: issued together, the two gathers may both
  // have landed by the time the next block ends.)
  CHECK(seen[kExplicit].ahead2 == kLayers - 2);
  CHECK(seen[kExplicit].behind2 == kLayers - 2);
  const auto& none = seen[kNone];
  CHECK(none.ahead1 + none.ahead2 + none.behind1 + none.behind2 == 0);
}

// reshard_after_forward observed: between forward and backward, what each block holds besides its
// shards, and whether its backward gathers again over the whole shard group (4 ranks). true: nothing
// held, gathered again; false: the whole unsharded parameters held, no gather; 2: half of the
// gathered bytes held, and the backward's gather within pairs of ranks, not over all 4.
TEST_CASE(
    "reshard_after_forward observed: memory held between forward and backward, and where backward gathers") {
  constexpr int kLayers = 3;
  for (const std::variant<bool, int> setting :
       {std::variant<bool, int>(true), std::variant<bool, int>(false), std::variant<bool, int>(2)})
    test::run_ranks(4, [&](comm::Comm& world) {
      EventLog log;
      comm::Comm comm(std::make_shared<LoggingComm>(world.impl_ptr(), log));
      comm.set_consistency_check(false);
      fsdp::FullyShardOptions o;
      o.reshard_after_forward = setting;
      auto net = LoggedNet(64, kLayers, log);
      auto model = fsdp::fully_shard(net, comm, o);
      auto x = at::randn({4, 64}).requires_grad_(true);
      model->forward(x).sum().backward();
      auto y = model->forward(x).sum();
      log.clear();
      const bool is_true = setting.index() == 0 && std::get<bool>(setting);
      const bool is_false = setting.index() == 0 && !std::get<bool>(setting);
      INFO("setting " << (setting.index() == 0 ? (is_true ? "true" : "false") : "2") << " rank "
                      << world.rank());
      std::vector<int64_t> held, full;
      for (int i = 0; i < kLayers; ++i) {
        const auto& group = net->blocks[i]->as<fsdp::FullyShardImpl<LoggedBlock>>()->fsdp_unit().group();
        held.push_back(group.held_bytes());
        full.push_back(group.unsharded_bytes());
      }
      y.backward();
      for (int i = 0; i < kLayers; ++i) {
        CAPTURE(i);
        const bool gathered_over_all = log.find("AG blocks." + std::to_string(i)) >= 0;
        if (is_true) {
          CHECK(held[i] == 0);
          CHECK(gathered_over_all);
        } else if (is_false) {
          CHECK(held[i] >= full[i]);
          CHECK_FALSE(gathered_over_all);
        } else {
          CHECK(held[i] > 0);
          CHECK(held[i] < full[i]);
          CHECK(2 * held[i] >= full[i]);
          CHECK_FALSE(gathered_over_all);
        }
      }
    });
}
