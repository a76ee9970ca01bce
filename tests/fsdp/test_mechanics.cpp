// fully_shard: an independent float64 oracle, collective counts, mixed precision, tied and unused
// parameters, identity of parameters, and misuse.
#include <ATen/record_function.h>
#include <Eigen/Dense>
#include <fmt/format.h>

#include <map>
#include <set>
#include <thread>
#include <atomic>
#include <cstring>

#include "fsdpp/base/storage.hpp"
#include "fsdp/counting_comm.hpp"
#include "fsdp/models.hpp"

using namespace fsdpp;

namespace {

// Wraps `comm` so its operations are counted.
std::pair<comm::Comm, std::shared_ptr<test::CountingComm>> counted(comm::Comm& comm) {
  auto c = std::make_shared<test::CountingComm>(comm.impl_ptr());
  comm::Comm counted_comm(c);
  counted_comm.set_consistency_check(false);  // its own all-gathers would be counted too
  return {counted_comm, c};
}

}  // namespace

TEST_CASE("sharded float32 gradients of an MLP match an Eigen float64 oracle at world size 3") {
  // MLP 4 -> 7 -> 2 with tanh, loss = mean squared error over a batch of 6.
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  auto g = at::detail::createCPUGenerator(99);
  const auto w1 = at::randn({7, 4}, g), b1 = at::randn({7}, g), w2 = at::randn({2, 7}, g),
             b2 = at::randn({2}, g), x = at::randn({6, 4}, g), y = at::randn({6, 2}, g);
  auto to_eigen = [](const at::Tensor& t) {
    auto d = t.to(at::kDouble).contiguous().view({t.size(0), t.dim() > 1 ? t.size(1) : 1});
    return Mat(Eigen::Map<const Mat>(d.data_ptr<double>(), d.size(0), d.size(1)));
  };
  const Mat W1 = to_eigen(w1), B1 = to_eigen(b1), W2 = to_eigen(w2), B2 = to_eigen(b2), X = to_eigen(x),
            Y = to_eigen(y);
  // Forward and backward by hand, in float64.
  const Mat Z1 = (X * W1.transpose()).rowwise() + B1.transpose().row(0);
  const Mat H = Z1.array().tanh().matrix();
  const Mat O = (H * W2.transpose()).rowwise() + B2.transpose().row(0);
  const Mat dO = 2.0 * (O - Y) / static_cast<double>(O.size());
  const Mat dW2 = dO.transpose() * H, dB2 = dO.colwise().sum().transpose();
  const Mat dZ1 = ((dO * W2).array() * (1 - H.array().square())).matrix();
  const Mat dW1 = dZ1.transpose() * X, dB1 = dZ1.colwise().sum().transpose();
  const std::map<std::string, Mat> oracle = {
      {"0.weight", dW1}, {"0.bias", dB1}, {"2.weight", dW2}, {"2.bias", dB2}};

  test::run_ranks(3, [&](comm::Comm& comm) {
    auto mlp = torch::nn::Sequential(torch::nn::Linear(4, 7), torch::nn::Functional(at::tanh),
                                     torch::nn::Linear(7, 2));
    {
      at::NoGradGuard no_grad;
      auto p = mlp->named_parameters();
      p["0.weight"].copy_(w1), p["0.bias"].copy_(b1), p["2.weight"].copy_(w2), p["2.bias"].copy_(b2);
    }
    auto model = fsdp::fully_shard(mlp, comm);
    // Each rank takes 2 of the 6 rows; the reduce-scatter averages, giving the full-batch mean.
    const auto r = comm.rank();
    at::mse_loss(model->forward(x.narrow(0, 2 * r, 2)), y.narrow(0, 2 * r, 2)).backward();
    for (const auto& s : fsdp::shards(*model.ptr())) {
      INFO(s.name << " on rank " << r);
      REQUIRE(oracle.count(s.name) == 1);
      const Mat& full = oracle.at(s.name);
      REQUIRE(s.param.grad().defined());
      const auto got = to_eigen(s.param.grad().reshape({s.info.local_rows, full.cols()}));
      for (int64_t i = 0; i < s.info.local_rows; ++i)
        for (int64_t j = 0; j < full.cols(); ++j)
          CHECK(std::abs(got(i, j) - full(s.info.row_offset + i, j)) <=
                1e-5 * (std::abs(full(s.info.row_offset + i, j)) + 1e-3));
    }
  });
}

TEST_CASE("one all-gather per unit per unshard and one reduce-scatter per unit per synced backward") {
  for (bool mixed : {false, true})
    test::run_ranks(2, [&](comm::Comm& world) {
      auto [comm, counter] = counted(world);
      auto net = test::Net(6, 3);
      fsdp::FullyShardOptions o;
      if (mixed) {  // bfloat16 compute with float32 norms: still one all-gather per unit
        o.mp.param_dtype = at::kBFloat16;
        o.mp.param_dtype_override = fsdp::dtype_for({"*norm*"}, at::kFloat);
      }
      auto model = fsdp::fully_shard(net, comm, o);
      const int units = 4;  // 3 blocks and the root
      auto x = at::randn({4, 5});
      counter->reset();
      model->set_requires_gradient_sync(false);
      model->forward(x).sum().backward();
      // Forward gathers every unit; backward gathers again the units resharded after forward
      // (all but the root). No reduce-scatter without gradient sync.
      CHECK(counter->all_gathers == units + (units - 1));
      CHECK(counter->reduce_scatters == 0);
      counter->reset();
      model->set_requires_gradient_sync(true);
      model->forward(x).sum().backward();
      CHECK(counter->all_gathers == units + (units - 1));
      CHECK(counter->reduce_scatters == units);
      counter->reset();
      fsdp::clip_grad_norm(*model.ptr(), 1.0);
      CHECK(counter->all_reduces == 1);
    });
}

TEST_CASE("squared_sum: float32 and float64 read in place, other dtypes and strided views through ATen") {
  at::manual_seed(3);
  const auto f32 = at::randn({1003});  // not a multiple of the 4 running sums
  const auto f64 = at::randn({7}, at::kDouble) * 1e3;
  const auto bf16 = at::randn({5}).to(at::kBFloat16);
  const auto strided = at::randn({3, 4}).t();  // not contiguous
  const std::vector<at::Tensor> all = {f32, f64, bf16, strided, at::empty({0})};
  // The oracle: every element widened to long double, squared and added in order.
  auto oracle = [](const std::vector<at::Tensor>& ts) {
    long double sum = 0;
    for (const auto& t : ts) {
      const auto d = t.to(at::kDouble).contiguous();
      for (int64_t i = 0; i < d.numel(); ++i)
        sum += static_cast<long double>(d.data_ptr<double>()[i]) * d.data_ptr<double>()[i];
    }
    return static_cast<double>(sum);
  };
  const auto got = fsdp::squared_sum(all, at::kCPU);
  CHECK(got.dim() == 0);
  CHECK(std::string(c10::toString(got.scalar_type())) == "Double");
  CHECK(got.item<double>() == doctest::Approx(oracle(all)).epsilon(1e-14));
  for (const auto& t : all) {  // each alone too: the in-place paths and the ATen one
    const std::string dtype = c10::toString(t.scalar_type());
    CAPTURE(dtype);
    CHECK(fsdp::squared_sum({t}, at::kCPU).item<double>() == doctest::Approx(oracle({t})).epsilon(1e-14));
  }
  CHECK(fsdp::squared_sum({}, at::kCPU).item<double>() == 0);
}

namespace {

// ATen operators (and autograd nodes) run on this thread while `f` runs, counted by name.
std::map<std::string, int64_t> operators_run_by(const std::function<void()>& f) {
  thread_local std::map<std::string, int64_t>* counts = nullptr;
  std::map<std::string, int64_t> mine;
  counts = &mine;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        if (counts) ++(*counts)[fn.name()];
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  f();
  at::removeCallback(handle);
  counts = nullptr;
  return mine;
}

}  // namespace

// The framework's per-unit work (unshard, packing gradients, handing out sharded gradients) is raw
// copies into persistent views, not ATen calls, and its post-backward is a hook on the node that
// produced the block's input (Note [post-backward hook]), not a node of its own: a sharded step
// runs no operator or autograd node the plain model does not. A reshape, narrow or empty_like per
// parameter per step, or an identity node per block, would show here.
TEST_CASE(
    "a sharded forward and backward run no ATen operator the unsharded model does not, at 1 and 3 ranks") {
  for (int world : {1, 3})
    test::run_ranks(world, [](comm::Comm& comm) {
      auto plain = test::Net(8, 3);
      auto net = test::Net(8, 3);
      test::copy_params(*net, *plain);
      auto model = fsdp::fully_shard(net, comm);
      const auto x = at::randn({6, 5}, at::detail::createCPUGenerator(3));
      auto step = [&](auto& m, const std::vector<at::Tensor>& params) {
        for (auto p : params) p.mutable_grad() = at::Tensor();  // as zero_grad(set_to_none)
        return operators_run_by([&] { m->forward(x).square().sum().backward(); });
      };
      for (int i = 0; i < 2; ++i) step(plain, plain->parameters()), step(model, model->sharded_parameters());
      auto plain_ops = step(plain, plain->parameters());
      const auto sharded_ops = step(model, model->sharded_parameters());
      std::string extra;
      for (const auto& [name, n] : sharded_ops)
        if (n > plain_ops[name]) extra += fmt::format(" {} ({} against {})", name, n, plain_ops[name]);
      INFO("rank ", comm.rank(), " of ", comm.size(), ":", extra);
      CHECK(extra.empty());
      for (const auto& p : model->sharded_parameters()) CHECK(p.grad().defined());
    });
}

namespace {

// Records the dtypes its parameters have while its forward runs.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    norm_weight = register_parameter("norm_weight", at::ones({4}));
  }
  at::Tensor forward(at::Tensor x) {
    seen_fc = fc->weight.scalar_type();
    seen_norm = norm_weight.scalar_type();
    seen_input = x.scalar_type();
    return fc(x) * norm_weight.to(x.scalar_type());
  }
  torch::nn::Linear fc{nullptr};
  at::Tensor norm_weight;
  at::ScalarType seen_fc{}, seen_norm{}, seen_input{};
};

}  // namespace

TEST_CASE("mixed precision: bfloat16 compute, float32 overrides, output dtype") {
  test::run_ranks(2, [](comm::Comm& comm) {
    auto probe = std::make_shared<ProbeImpl>();
    fsdp::FullyShardOptions o;
    o.mp.param_dtype = at::kBFloat16;
    o.mp.output_dtype = at::kFloat;
    o.mp.param_dtype_override = fsdp::dtype_for({"*norm*"}, at::kFloat);
    auto model = fsdp::fully_shard(probe, comm, o);
    auto out = model->forward(at::randn({3, 4}));
    CHECK((probe->seen_fc == at::kBFloat16));
    CHECK((probe->seen_norm == at::kFloat));
    CHECK((probe->seen_input == at::kBFloat16));  // cast_forward_inputs
    CHECK((out.scalar_type() == at::kFloat));     // output_dtype
    out.sum().backward();
    for (const auto& s : fsdp::shards(*model.ptr())) {
      CHECK((s.param.scalar_type() == at::kFloat));  // the optimizer's copy keeps its dtype
      CHECK((s.param.grad().scalar_type() == at::kFloat));
    }
  });
}

TEST_CASE(
    "mixed precision: reduce_dtype is the dtype the reduce-scatter carries; inputs left alone on request") {
  // With bfloat16 compute, each reduce_dtype reaches the wire as itself (a reduction that ignored
  // it would carry bfloat16 every time), and the averaged gradient agrees with a float64 reference
  // as closely as that dtype allows.
  auto g = at::detail::createCPUGenerator(11);
  const auto x = at::randn({6, 4}, g) * 3;
  auto init = std::make_shared<ProbeImpl>();
  {
    at::NoGradGuard no_grad;
    for (auto& p : init->parameters()) p.copy_(at::randn(p.sizes(), g));
  }
  std::map<std::string, double> error;
  for (const auto reduce : {at::kFloat, at::kBFloat16})
    test::run_ranks(2, [&](comm::Comm& plain) {
      auto [comm, counter] = counted(plain);
      auto probe = std::make_shared<ProbeImpl>();
      {
        at::NoGradGuard no_grad;
        for (auto& p : probe->named_parameters()) p.value().copy_(init->named_parameters()[p.key()]);
      }
      fsdp::FullyShardOptions o;
      o.mp.param_dtype = at::kBFloat16;
      o.mp.reduce_dtype = reduce;
      auto model = fsdp::fully_shard(probe, comm, o);
      // Each rank its own scale, so that the reduction sums different values.
      (model->forward(x * (1 + comm.rank())).pow(2).sum() * 1e3).backward();
      const auto dtypes = counter->reduce_scatter_dtypes();
      REQUIRE(!dtypes.empty());
      for (const auto d : dtypes) CHECK((d == reduce));
      // float64 reference: the mean over both ranks of the bfloat16 model's gradients.
      double num = 0, den = 0;
      for (const auto& s : fsdp::shards(*model.ptr())) {
        at::Tensor want;
        for (int r = 0; r < 2; ++r) {
          auto ref = std::make_shared<ProbeImpl>();
          {
            at::NoGradGuard no_grad;
            for (auto& p : ref->named_parameters()) p.value().copy_(init->named_parameters()[p.key()]);
          }
          ref->to(at::kBFloat16);
          (ref->forward((x * (1 + r)).to(at::kBFloat16)).pow(2).sum() * 1e3).backward();
          auto grad = ref->named_parameters()[s.name].grad().to(at::kDouble) / 2;
          want = want.defined() ? want + grad : grad;
        }
        want = want.narrow(0, s.info.row_offset, s.info.local_rows);
        num += (s.param.grad().to(at::kDouble) - want).pow(2).sum().item<double>();
        den += want.pow(2).sum().item<double>();
      }
      if (comm.rank() == 0) error[c10::toString(reduce)] = std::sqrt(num / den);
    });
  MESSAGE("relative error, float32 reduction: " << error["Float"] << ", bfloat16: " << error["BFloat16"]);
  CHECK(error["Float"] < error["BFloat16"]);

  // cast_forward_inputs=false: the unit's forward gets its float32 input as it came.
  struct InputProbeImpl : torch::nn::Module {
    InputProbeImpl() { weight = register_parameter("weight", at::ones({4, 4})); }
    at::Tensor forward(const at::Tensor& x) {
      seen = x.scalar_type();
      return at::linear(x.to(weight.scalar_type()), weight);
    }
    at::Tensor weight;
    at::ScalarType seen{};
  };
  for (const bool cast : {true, false})
    test::run_ranks(2, [&](comm::Comm& comm) {
      auto probe = std::make_shared<InputProbeImpl>();
      fsdp::FullyShardOptions o;
      o.mp.param_dtype = at::kBFloat16;
      o.mp.cast_forward_inputs = cast;
      auto model = fsdp::fully_shard(probe, comm, o);
      model->forward(at::ones({3, 4}));
      CHECK((probe->seen == (cast ? at::kBFloat16 : at::kFloat)));
    });
}

TEST_CASE(
    "bfloat16 compute of float32 parameters accumulates 8 microbatches in float32 (2.15), closer to "
    "float64") {
  // The same 8 no-sync microbatches with unsharded gradients accumulated by PyTorch 2.15's default
  // (reduce_dtype and grad_dtype unset: the parameters' own float32) and in bfloat16 (a bfloat16
  // grad_dtype, what the compute dtype gave before 2.15), against the float64 sum of the same
  // gradients.
  auto g = at::detail::createCPUGenerator(5);
  auto init = test::Net(16, 2);
  {
    at::NoGradGuard no_grad;
    for (auto& p : init->parameters()) p.copy_(at::randn(p.sizes(), g) * 0.5);
  }
  std::vector<at::Tensor> xs;
  for (int m = 0; m < 8; ++m) xs.push_back(at::randn({4, 5}, g) * (1 + m));
  // Reference: each microbatch's bfloat16 gradient from the unwrapped bfloat16 model (the same
  // computation the sharded run does), summed in float64. What remains is accumulation error.
  auto ref = test::Net(16, 2);
  test::copy_params(*ref, *init);
  ref->to(at::kBFloat16);
  std::map<std::string, at::Tensor> ref_grads;
  for (const auto& x : xs) {
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
    ref->forward(x.to(at::kBFloat16)).pow(2).sum().backward();
    for (auto& p : ref->named_parameters()) {
      auto g = p.value().grad().to(at::kDouble);
      ref_grads[p.key()] = ref_grads.count(p.key()) ? ref_grads[p.key()] + g : g;
    }
  }
  std::map<bool, double> error;  // keyed by "the default, float32 accumulation"
  for (bool fp32_acc : {false, true})
    test::run_ranks(2, [&](comm::Comm& comm) {
      auto net = test::Net(16, 2);
      test::copy_params(*net, *init);
      fsdp::FullyShardOptions o;
      o.mp.param_dtype = at::kBFloat16;
      if (!fp32_acc)
        o.mp.grad_dtype = [](const std::string&, const at::Tensor&) { return std::optional(at::kBFloat16); };
      auto model = fsdp::fully_shard(net, comm, o);
      // Both ranks see all microbatches; the average over 2 ranks is then the sum itself.
      for (int m = 0; m < 8; ++m) {
        model->set_requires_gradient_sync(m == 7);
        model->forward(xs[m]).pow(2).sum().backward();
      }
      double num = 0, den = 0;
      for (const auto& s : fsdp::shards(*model.ptr())) {
        auto want = ref_grads[s.name].narrow(0, s.info.row_offset, s.info.local_rows);
        num += (s.param.grad().to(at::kDouble) - want).pow(2).sum().item<double>();
        den += want.pow(2).sum().item<double>();
      }
      auto t = at::tensor({num, den}, at::kDouble);
      comm.all_reduce(t).wait();
      if (comm.rank() == 0) error[fp32_acc] = std::sqrt(t[0].item<double>() / t[1].item<double>());
    });
  MESSAGE("relative error, bfloat16 grad_dtype: " << error[false]
                                                  << ", the default (float32): " << error[true]);
  CHECK(error[true] * 10 < error[false]);
}

namespace {

struct AffineImpl : torch::nn::Module {
  AffineImpl(at::Tensor w, int64_t n) {
    weight = register_parameter("weight", std::move(w));
    bias = register_parameter("bias", at::zeros({n}));
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  at::Tensor weight, bias;
};

// emb and out share one weight, as shared embedding and output weights do.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    auto w = at::randn({5, 5});
    emb = register_module("emb", std::make_shared<AffineImpl>(w, 5));
    out = register_module("out", std::make_shared<AffineImpl>(w, 5));
  }
  at::Tensor forward(at::Tensor x) { return out->forward(at::tanh(emb->forward(x))); }
  std::shared_ptr<AffineImpl> emb, out;
};

}  // namespace

TEST_CASE("tied parameters are managed once and train like the unsharded model (5 rows on 3 ranks)") {
  auto g = at::detail::createCPUGenerator(3);
  auto init = std::make_shared<TiedImpl>();
  {
    at::NoGradGuard no_grad;
    for (auto& p : init->parameters()) p.copy_(at::randn(p.sizes(), g));
  }
  const auto x = at::randn({6, 5}, g), y = at::randn({6, 5}, g);
  auto ref = std::make_shared<TiedImpl>();
  test::copy_params(*ref, *init);
  // The tied weight appears under two names; the optimizer must see it once.
  std::vector<at::Tensor> unique;
  for (auto& p : ref->parameters())
    if (std::none_of(unique.begin(), unique.end(), [&](const at::Tensor& u) { return u.is_same(p); }))
      unique.push_back(p);
  torch::optim::AdamW ropt(unique, torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 5; ++s) {
    ropt.zero_grad();
    at::mse_loss(ref->forward(x), y).backward();
    ropt.step();
  }
  test::run_ranks(3, [&](comm::Comm& comm) {
    auto m = std::make_shared<TiedImpl>();
    test::copy_params(*m, *init);
    auto model = fsdp::fully_shard(m, comm);
    CHECK(fsdp::shards(*model.ptr()).size() == 3);  // emb.weight (= out.weight), emb.bias, out.bias
    torch::optim::AdamW opt(model->sharded_parameters(), torch::optim::AdamWOptions(1e-2));
    const auto r = comm.rank();
    for (int s = 0; s < 5; ++s) {
      opt.zero_grad();
      at::mse_loss(model->forward(x.narrow(0, 2 * r, 2)), y.narrow(0, 2 * r, 2)).backward();
      opt.step();
    }
    auto full = fsdp::full_state_dict(*model.ptr());
    CHECK(full.size() == 4);  // both names of the tied weight
    auto want = ref->named_parameters();
    for (auto& [name, value] : full) {
      INFO(name);
      CHECK(test::rel_diff(value, want[name]) < 1e-5);
    }
  });
}

namespace {

// An "expert" used only when the batch says so, as an MoE expert that receives no tokens.
struct GatedImpl : torch::nn::Module {
  GatedImpl() {
    base = register_module("base", torch::nn::Linear(4, 4));
    expert = register_module("expert", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(at::Tensor x, bool use_expert) {
    auto h = base(x);
    return use_expert ? h + expert(h) : h;
  }
  torch::nn::Linear base{nullptr}, expert{nullptr};
};

}  // namespace

TEST_CASE("a parameter that gets no gradient on some rank is reduced as zeros, without a hang") {
  auto g = at::detail::createCPUGenerator(11);
  const auto x = at::randn({4, 4}, g);
  auto init = std::make_shared<GatedImpl>();
  // Expected: rank 0 alone uses the expert, so its gradient is rank 0's over 2 ranks.
  auto ref = std::make_shared<GatedImpl>();
  test::copy_params(*ref, *init);
  ref->forward(x.narrow(0, 0, 2), true).sum().backward();
  const auto want = ref->expert->weight.grad() / 2;
  test::run_ranks(2, [&](comm::Comm& comm) {
    auto m = std::make_shared<GatedImpl>();
    test::copy_params(*m, *init);
    auto model = fsdp::fully_shard(m, comm);
    model->forward(x.narrow(0, 2 * comm.rank(), 2), comm.rank() == 0).sum().backward();
    for (const auto& s : fsdp::shards(*model.ptr()))
      if (s.name == "expert.weight")
        CHECK(test::rel_diff(s.param.grad(), want.narrow(0, s.info.row_offset, s.info.local_rows)) < 1e-6);
  });
}

TEST_CASE("unshard and reshard change storage, not the parameter objects") {
  test::run_ranks(2, [](comm::Comm& comm) {
    auto net = test::Net(6, 2);
    std::map<std::string, const void*> before;
    for (auto& p : net->named_parameters()) before[p.key()] = p.value().unsafeGetTensorImpl();
    auto model = fsdp::fully_shard(net, comm);
    for (auto& p : model->named_parameters()) {
      INFO(p.key());
      CHECK(before.at(p.key()) == p.value().unsafeGetTensorImpl());
      CHECK(p.value().storage().nbytes() == 0);  // resharded
    }
    model->unshard();
    // Note [unshard by storage resize]: a unit's parameters lie in one buffer, each 64-byte aligned.
    std::map<std::string, const void*> buffers;  // unit -> its buffer
    for (auto& p : model->named_parameters()) {
      const auto& t = p.value();
      INFO(p.key());
      CHECK(t.storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size());
      CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0);
      const std::string unit =
          p.key().rfind("blocks.", 0) == 0 ? p.key().substr(0, p.key().find('.', 7)) : "root";
      const auto [it, first] = buffers.emplace(unit, t.storage().data());
      CHECK(it->second == t.storage().data());
    }
    std::set<const void*> distinct;
    for (const auto& [unit, buffer] : buffers) distinct.insert(buffer);
    CHECK(buffers.size() == 3);
    CHECK(distinct.size() == 3);
    model->reshard();
    for (auto& p : model->named_parameters()) CHECK(p.value().storage().nbytes() == 0);
  });
}

TEST_CASE(
    "resharding gives host buffers to the cache and the next unshard takes them back; limit 0 frees them") {
  test::run_ranks(1, [](comm::Comm& comm) {
    const int64_t limit = host_buffer_cache_stats().limit_bytes;
    REQUIRE(limit > 0);
    auto model = fsdp::fully_shard(test::Net(8, 3), comm);
    const auto x = at::randn({6, 5}, at::detail::createCPUGenerator(5));
    auto step = [&](auto& m, const std::vector<at::Tensor>& params) {
      for (auto p : params) p.mutable_grad() = at::Tensor();
      m->forward(x).square().sum().backward();
    };
    step(model, model->sharded_parameters());
    const auto a = host_buffer_cache_stats();
    step(model, model->sharded_parameters());
    const auto b = host_buffer_cache_stats();
    // Every buffer the second step needs was released by the first, or earlier in the second.
    CHECK(b.misses == a.misses);
    // Per block: 2 unshards and the reduce buffer (alone in its shard group, a unit's gather fills
    // its unsharded buffer: Note [one-rank buffers]).
    CHECK(b.hits - a.hits >= 3 * 3);
    CHECK(b.cached_bytes > 0);
    CHECK(b.cached_bytes <= b.limit_bytes);

    set_host_buffer_cache_limit(0);
    const auto c = host_buffer_cache_stats();
    CHECK(c.cached_bytes == 0);
    CHECK(host_buffer_cache_limit() == 0);
    step(model, model->sharded_parameters());
    const auto d = host_buffer_cache_stats();
    CHECK(d.hits == c.hits);
    CHECK(d.misses - c.misses == b.hits - a.hits);    // the same allocations, from the allocator now
    CHECK(d.freed - c.freed == d.misses - c.misses);  // and every one freed again
    CHECK(d.cached_bytes == 0);
    set_host_buffer_cache_limit(limit);
  });
}

// Note [host buffer cache]: threads taking and giving buffers of the same sizes at once (a
// pipeline's stages, the gradient-reduce worker) never get the same buffer, and the cache's books
// balance afterwards.
TEST_CASE("the host buffer cache hands a buffer to one thread at a time") {
  const auto before = host_buffer_cache_stats();
  REQUIRE(before.limit_bytes > 0);
  REQUIRE(host_buffer_cache_limit() == before.limit_bytes);
  constexpr int kThreads = 4, kRounds = 4000;
  const size_t sizes[] = {4096, 64 * 1024};
  std::atomic<int> bad{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      // Two tensors per thread, one of each size, so every size has several takers.
      std::vector<at::Tensor> mine;
      for (size_t n : sizes) mine.push_back(at::empty({int64_t(n)}, at::kByte));
      for (auto& m : mine) resize_storage_bytes_cached(m, 0);
      while (!go.load()) std::this_thread::yield();
      for (int r = 0; r < kRounds; ++r)
        for (size_t i = 0; i < mine.size(); ++i) {
          auto* p = static_cast<unsigned char*>(resize_storage_bytes_cached(mine[i], sizes[i]));
          const unsigned char mark = static_cast<unsigned char>(t * 64 + r % 64);
          std::memset(p, mark, sizes[i]);
          std::this_thread::yield();  // another thread holding the same buffer would write now
          if (p[0] != mark || p[sizes[i] / 2] != mark || p[sizes[i] - 1] != mark) bad.fetch_add(1);
          resize_storage_bytes_cached(mine[i], 0);
        }
    });
  go = true;
  for (auto& th : threads) th.join();
  CHECK(bad.load() == 0);
  const auto after = host_buffer_cache_stats();
  const int64_t takes = int64_t(kThreads) * kRounds * 2;
  CHECK(after.hits + after.misses - before.hits - before.misses == takes);
  // Every buffer taken was given back: cached, or freed with the cache full.
  CHECK(after.misses - before.misses <= kThreads * 2 + (after.freed - before.freed));
  CHECK(after.cached_bytes <= after.limit_bytes);
  CHECK(after.cached_bytes - before.cached_bytes >= 0);
}

// Note [one-rank buffers]
TEST_CASE(
    "alone in its shard group, a unit gathers into its parameters' own buffer; values and gradients are the "
    "plain model's, bit for bit") {
  test::run_ranks(1, [](comm::Comm& comm) {
    for (bool bf16 : {false, true}) {
      INFO((bf16 ? "bfloat16 compute, float32 reduce" : "float32"));
      auto plain = test::Net(8, 3);
      auto net = test::Net(8, 3);
      test::copy_params(*net, *plain);
      fsdp::FullyShardOptions o;
      if (bf16) {
        o.mp.param_dtype = at::kBFloat16;  // the shard is cast into the parameter
        o.mp.reduce_dtype = at::kFloat;    // and the gradient into the reduce buffer
        plain->to(at::kBFloat16);
      }
      auto model = fsdp::fully_shard(net, comm, o);
      model->unshard();
      for (fsdp::Unit* u : model->fsdp_unit().tree_units()) {
        const auto where = u->group().buffer_addresses();  // gather, reduce, unsharded
        INFO(u->label());
        CHECK(where[0] != nullptr);
        CHECK(where[0] == where[2]);
      }
      auto plain_params = plain->named_parameters();
      for (auto& p : model->named_parameters()) {
        INFO(p.key());
        CHECK(at::equal(p.value(), plain_params[p.key()]));
      }
      model->reshard();
      for (int64_t seed : {1, 2}) {
        const auto x = at::randn({6, 5}, at::detail::createCPUGenerator(seed));
        for (auto p : model->sharded_parameters()) p.mutable_grad() = at::Tensor();
        for (auto p : plain->parameters()) p.mutable_grad() = at::Tensor();
        model->forward(x).square().sum().backward();
        plain->forward(x.to(plain->parameters()[0].scalar_type())).square().sum().backward();
        for (const auto& s : fsdp::shards(*model.ptr())) {
          INFO(s.name << ", input " << seed);
          REQUIRE(s.param.grad().defined());
          CHECK(at::equal(s.param.grad(), plain_params[s.name].grad().to(s.param.grad().scalar_type())));
        }
      }
    }
  });
}

// Note [spare gradients]
TEST_CASE(
    "a sharded gradient dropped by zero_grad is refilled, not made again; one still held elsewhere is left "
    "alone") {
  test::run_ranks(1, [](comm::Comm& comm) {
    const int64_t limit = host_buffer_cache_stats().limit_bytes;
    REQUIRE(limit > 0);
    auto model = fsdp::fully_shard(test::Net(8, 3), comm);
    const auto params = model->sharded_parameters();
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));  // for its zero_grad only
    auto step = [&](int64_t seed) {
      opt.zero_grad();  // set_to_none, after a detach_ that gives each gradient autograd metadata
      model->forward(at::randn({6, 5}, at::detail::createCPUGenerator(seed))).square().sum().backward();
      std::vector<at::Tensor> grads;
      for (const auto& p : params) grads.push_back(p.grad());
      return grads;
    };
    // Weak references keep a destroyed tensor's address from being reused, so equal addresses
    // mean the same tensor.
    using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
    std::vector<Weak> first;
    for (const auto& g : step(1)) first.emplace_back(g.getIntrusivePtr());
    const auto second = step(2);
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(first[i].lock().get() == second[i].unsafeGetTensorImpl());
      // Refilled as backward makes a gradient: no autograd metadata left from zero_grad's detach_,
      // which would put every optimizer operation on the gradient through a locked lookup.
      CHECK(second[i].unsafeGetTensorImpl()->autograd_meta() == nullptr);
    }

    // `second` still holds them: the next step makes new ones and leaves these as they were.
    std::vector<at::Tensor> copies;
    for (const auto& g : second) copies.push_back(g.clone());
    const auto third = step(3);
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(third[i].unsafeGetTensorImpl() != second[i].unsafeGetTensorImpl());
      CHECK(at::equal(second[i], copies[i]));
      CHECK(!at::equal(third[i], copies[i]));  // another input, other gradients
    }

    // With the cache off, a dropped gradient is gone, and the next step makes new ones.
    set_host_buffer_cache_limit(0);
    std::vector<Weak> dropped;
    for (const auto& g : step(4)) dropped.emplace_back(g.getIntrusivePtr());
    const auto fifth = step(5);
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(dropped[i].expired());
      CHECK(fifth[i].use_count() == 2);  // the parameter's .grad and `fifth`: no spare kept
    }
    set_host_buffer_cache_limit(limit);
  });
}

TEST_CASE("misuse is a clear error: sharding twice, rank-dependent overrides, bad dtypes") {
  test::run_ranks(2, [](comm::Comm& comm) {
    auto net = test::Net(6, 1);
    auto model = fsdp::fully_shard(net, comm);
    auto msg = test::error_of([&] { fsdp::fully_shard(net, comm); });
    CHECK(msg.find("is already managed by unit") != std::string::npos);

    fsdp::FullyShardOptions o;
    o.mp.param_dtype = at::kBFloat16;
    const int r = comm.rank();
    o.mp.param_dtype_override = [r](const std::string& name,
                                    const at::Tensor&) -> std::optional<at::ScalarType> {
      if (r == 0 && name == "head.weight") return at::kFloat;
      return std::nullopt;
    };
    msg = test::error_of([&] { fsdp::fully_shard(test::Net(6, 1), comm, o); });
    INFO(msg);
    CHECK(msg.find("disagree on parameter") != std::string::npos);

    fsdp::FullyShardOptions bad;
    bad.mp.param_dtype = at::kInt;
    msg = test::error_of([&] { fsdp::fully_shard(test::Net(6, 1), comm, bad); });
    CHECK(msg.find("param_dtype must be a floating-point dtype") != std::string::npos);
  });
}

namespace {

// Holds plain blocks in a ModuleList, as an existing model might; wrap_each converts them.
struct ListNetImpl : torch::nn::Module {
  ListNetImpl() { blocks = register_module("blocks", torch::nn::ModuleList(test::Block(6), test::Block(6))); }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : *blocks) {
      if (auto* unit = b->as<fsdp::FullyShardImpl<test::BlockImpl>>())
        x = unit->forward(x);
      else
        x = b->as<test::BlockImpl>()->forward(x);
    }
    return x;
  }
  torch::nn::ModuleList blocks{nullptr};
};

// Gradients of a model on the full batch, by name.
std::map<std::string, at::Tensor> reference_grads(torch::nn::Module& m,
                                                  const std::function<at::Tensor(at::Tensor)>& fwd,
                                                  const at::Tensor& x) {
  fwd(x).pow(2).mean().backward();
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

void check_shard_grads(fsdp::UnitHolder& root, const std::map<std::string, at::Tensor>& want) {
  const auto all = fsdp::shards(root);
  CHECK(all.size() == want.size());
  for (const auto& s : all) {
    INFO(s.name);
    REQUIRE(want.count(s.name) == 1);
    CHECK(test::rel_diff(s.param.grad(), want.at(s.name).narrow(0, s.info.row_offset, s.info.local_rows)) <
          1e-5);
  }
}

}  // namespace

TEST_CASE("blocks held in a Sequential, in a ModuleList via wrap_each, with explicit prefetch") {
  auto g = at::detail::createCPUGenerator(21);
  const auto x = at::randn({4, 3, 6}, g);
  auto init = torch::nn::Sequential(test::Block(6), test::Block(6));
  {
    at::NoGradGuard no_grad;
    for (auto& p : init->parameters()) p.copy_(at::randn(p.sizes(), g) * 0.5);
  }
  auto plain = torch::nn::Sequential(test::Block(6), test::Block(6));
  test::copy_params(*plain, *init);
  const auto want = reference_grads(
      *plain, [&](at::Tensor t) { return plain->forward(t); }, x);

  test::run_ranks(2, [&](comm::Comm& comm) {
    const auto local = x.narrow(0, 2 * comm.rank(), 2);
    {  // Sequential of units: torch::nn::Sequential calls them through AnyModule
      auto seq = torch::nn::Sequential(fsdp::FullyShard<test::Block>(test::Block(6)),
                                       fsdp::FullyShard<test::Block>(test::Block(6)));
      test::copy_params(*seq, *init);
      auto model = fsdp::fully_shard(seq, comm);
      model->forward(local).pow(2).mean().backward();
      check_shard_grads(*model.ptr(), want);
    }
    {  // an existing ModuleList of plain blocks, converted; names are unchanged
      auto net = std::make_shared<ListNetImpl>();
      net->blocks = net->replace_module("blocks", fsdp::wrap_each<test::BlockImpl>(net->blocks));
      std::map<std::string, at::Tensor> renamed;
      for (auto& [k, v] : want) renamed["blocks." + k] = v;
      auto src = init->named_parameters();
      {
        at::NoGradGuard no_grad;
        for (auto& p : net->named_parameters()) p.value().copy_(src[p.key().substr(7)]);
      }
      auto model = fsdp::fully_shard(net, comm);
      auto* b0 = dynamic_cast<fsdp::UnitHolder*>(net->blocks->ptr(0).get());
      auto* b1 = dynamic_cast<fsdp::UnitHolder*>(net->blocks->ptr(1).get());
      REQUIRE(b0);
      REQUIRE(b1);
      model->set_modules_to_forward_prefetch({b0, b1});  // both blocks as soon as the root gathers
      net->blocks->ptr(1)->as<fsdp::FullyShardImpl<test::BlockImpl>>()->set_modules_to_backward_prefetch(
          {b0});
      model->forward(local).pow(2).mean().backward();
      check_shard_grads(*model.ptr(), renamed);
    }
  });
}
