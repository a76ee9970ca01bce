// The GPU path, on the GPUs of the machine (built only against a CUDA LibTorch; scripts/gpu-check.sh
// runs it): NCCL through comm::Comm, fully_shard on CUDA against the unsharded model on the CPU,
// and a step captured as a CUDA graph against the same step run eagerly.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/comm/store.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdp/models.hpp"
#include "fsdpp/base/cuda_graph.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/train/sharding.hpp"

using namespace fsdpp;

namespace {

int gpus() { return static_cast<int>(c10::cuda::device_count()); }

// Ranks as threads, one GPU each (rank r on GPU r), over NCCL.
void run_nccl_ranks(int n, const std::function<void(comm::Comm&, int device)>& body) {
  test::run_rank_threads(
      n,
      [n](int r, const std::string& path) {
        c10::cuda::set_device(static_cast<c10::DeviceIndex>(r));
        comm::InitOptions o;
        o.backend = comm::Backend::kNccl;
        o.timeout = std::chrono::seconds(60);
        return comm::connect(comm::make_file_store(path, n, o.timeout), r, n, o);
      },
      [&](comm::Comm& comm) { body(comm, comm.rank()); });
}

at::TensorOptions on(int device, at::ScalarType t = at::kFloat) {
  return at::TensorOptions(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))).dtype(t);
}

}  // namespace

TEST_CASE("NCCL through comm::Comm: every operation on CUDA tensors") {
  REQUIRE(gpus() >= 1);
  const int n = std::min(2, gpus());
  MESSAGE("world size " << n << " (" << gpus() << " GPUs)");
  run_nccl_ranks(n, [n](comm::Comm& comm, int d) {
    const int r = comm.rank();
    CHECK(std::string(comm.backend()) == "nccl");
    auto t = at::full({5}, double(r + 1), on(d));
    comm.all_reduce(t).wait();
    t.add_(1);  // ordered after the all-reduce on the device, without a host wait
    CHECK(at::allclose(t.cpu(), at::full({5}, n * (n + 1) / 2.0 + 1)));

    auto h = at::full({4}, double(r + 1), on(d, at::kBFloat16));
    comm.all_reduce(h, {comm::ReduceOp::kAvg}).wait();
    CHECK(at::allclose(h.cpu().to(at::kFloat), at::full({4}, (n + 1) / 2.0)));

    auto out = at::empty({3 * n}, on(d));
    comm.all_gather(out, at::full({3}, double(r), on(d))).wait();
    for (int q = 0; q < n; ++q) CHECK(at::equal(out.cpu().narrow(0, 3 * q, 3), at::full({3}, double(q))));

    // Uneven parts: rank q contributes q + 1 elements.
    std::vector<int64_t> counts;
    for (int q = 0; q < n; ++q) counts.push_back(q + 1);
    auto uneven = at::empty({n * (n + 1) / 2}, on(d, at::kLong));
    comm.all_gather(uneven, at::full({r + 1}, int64_t(r), on(d, at::kLong)), {counts}).wait();
    int64_t at_ = 0;
    for (int q = 0; q < n; ++q)
      for (int i = 0; i <= q; ++i) CHECK(uneven.cpu()[at_++].item<int64_t>() == q);

    auto rs_in = at::arange(4 * n, on(d)) + double(r);
    auto rs_out = at::empty({4}, on(d));
    comm.reduce_scatter(rs_out, rs_in).wait();
    const auto want = at::arange(4 * n, at::kFloat).narrow(0, 4 * r, 4) * n + double(n * (n - 1) / 2);
    CHECK(at::equal(rs_out.cpu(), want));

    auto b = at::full({2}, r == 0 ? 7.0 : -1.0, on(d));
    comm.broadcast(b).wait();
    CHECK(at::equal(b.cpu(), at::full({2}, 7.0)));

    auto a2a_in = at::arange(2 * n, on(d)) + 100.0 * r, a2a_out = at::empty({2 * n}, on(d));
    comm.all_to_all(a2a_out, a2a_in).wait();
    for (int q = 0; q < n; ++q)
      CHECK(at::equal(a2a_out.cpu().narrow(0, 2 * q, 2), at::arange(2, at::kFloat) + 2.0 * r + 100.0 * q));

    if (n == 2) {
      auto msg = at::full({6}, double(r), on(d));
      auto got = at::empty({6}, on(d));
      if (r == 0) {
        comm.send(msg, 1, 3).wait();
        comm.recv(got, 1, 4).wait();
      } else {
        comm.recv(got, 0, 3).wait();
        comm.send(msg, 0, 4).wait();
      }
      CHECK(at::equal(got.cpu(), at::full({6}, double(1 - r))));
    }
    comm.barrier().wait();
    auto sub = comm.split(0, -r);  // reversed order
    REQUIRE(sub);
    CHECK(sub.rank() == n - 1 - r);
    auto s = at::ones({1}, on(d));
    sub.all_reduce(s).wait();
    CHECK(s.cpu().item<float>() == float(n));
  });
}

TEST_CASE("fully_shard on CUDA over NCCL trains like the unsharded model on the CPU") {
  REQUIRE(gpus() >= 1);
  const int n = std::min(2, gpus());
  const int steps = 10;
  const int64_t batch = 12;
  auto g = at::detail::createCPUGenerator(1234);
  const auto x = at::randn({batch, 5}, g), y = at::randn({batch, 3}, g);
  auto init = test::Net(8, 3);
  {
    auto gi = at::detail::createCPUGenerator(7);
    at::NoGradGuard no_grad;
    for (auto& p : init->parameters()) p.copy_(at::randn(p.sizes(), gi) * 0.3);
  }
  std::vector<double> want;
  {
    auto net = test::Net(8, 3);
    test::copy_params(*net, *init);
    fsdp::AdamW opt(net->parameters(), {.lr = 1e-2});
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto loss = at::mse_loss(net->forward(x), y);
      loss.backward();
      opt.step();
      want.push_back(loss.item<double>());
    }
  }
  std::vector<double> got(steps);
  run_nccl_ranks(n, [&](comm::Comm& comm, int d) {
    auto net = test::Net(8, 3);
    test::copy_params(*net, *init);
    net->to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)));
    auto model = fsdp::fully_shard(net, comm);
    fsdp::AdamW opt(model->sharded_parameters(), {.lr = 1e-2});
    const int64_t local = batch / n;
    const auto xl = x.narrow(0, comm.rank() * local, local).to(on(d)), yl = y.narrow(0, comm.rank() * local, local).to(on(d));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto loss = at::mse_loss(model->forward(xl), yl);
      loss.backward();
      opt.step();
      auto l = loss.detach().reshape({1}).clone();
      comm.all_reduce(l, {comm::ReduceOp::kAvg}).wait();
      if (comm.rank() == 0) got[s] = l.cpu().item<double>();
    }
  });
  for (int s = 0; s < steps; ++s) {
    INFO("step " << s << ": GPU " << got[s] << " CPU " << want[s]);
    CHECK(std::abs(got[s] - want[s]) <= 1e-5 * std::abs(want[s]) + 1e-7);
  }
}

namespace {

struct StepResult {
  std::vector<double> losses;
  std::vector<at::Tensor> params;  // on the CPU, at the end
  double step_ms = 0;              // median of the steps after the first 5
};

// A small MoE (capacity routing), fully_shard with static buffers, fsdp::AdamW, static inputs;
// `graph`: 3 eager steps, then capture once and replay.
StepResult train_moe(comm::Comm& comm, int d, bool graph, int steps) {
  models::MoEConfig c;
  c.dim = 128, c.heads = 4, c.layers = 4, c.max_seq_len = 128, c.ffn_hidden = 256;
  c.experts = 8, c.top_k = 2, c.expert_hidden = 128, c.dense_layers = 1;
  c.routing = "capacity";
  at::manual_seed(11);
  auto net = models::MoETransformer(c);
  net->to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)));
  fsdp::FullyShardOptions o;
  o.static_buffers = true;
  auto root = train::shard_model(net, comm, o);
  fsdp::AdamW opt(root->sharded_parameters(), {.lr = 3e-3});
  const int64_t B = 8, T = 128;
  auto x = at::zeros({B, T}, on(d, at::kLong)), yt = at::zeros({B, T}, on(d, at::kLong));
  at::Tensor loss_out;
  auto body = [&] {
    root->inner().router_stats().reset();
    opt.zero_grad();
    auto loss = models::lm_loss(root->forward(x), yt);
    loss.backward();
    opt.step();
    loss_out = loss.detach();
  };
  std::unique_ptr<CapturedStep> captured;
  StepResult out;
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    auto gen = at::detail::createCPUGenerator(500 + s * 7 + comm.rank());
    const auto data = at::randint(256, {B, T + 1}, gen);
    x.copy_(data.narrow(1, 0, T));
    yt.copy_(data.narrow(1, 1, T));
    opt.set_lr(3e-3 * (1.0 - 0.9 * s / steps));  // linear decay to a tenth, positive throughout
    c10::cuda::device_synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    if (graph && s >= 3) {
      if (!captured) captured = CapturedStep::capture(body);
      captured->replay();
    } else {
      body();
    }
    c10::cuda::device_synchronize();
    if (s >= 5) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    out.losses.push_back(loss_out.cpu().item<double>());
  }
  for (const auto& p : root->sharded_parameters()) out.params.push_back(p.detach().cpu());
  std::sort(times.begin(), times.end());
  out.step_ms = times.empty() ? 0 : times[times.size() / 2];
  return out;
}

}  // namespace

TEST_CASE("a step captured as a CUDA graph gives the same bits as the step run eagerly") {
  REQUIRE(gpus() >= 1);
  const int steps = 30;
  StepResult eager, graph;
  run_nccl_ranks(1, [&](comm::Comm& comm, int d) {
    eager = train_moe(comm, d, false, steps);
    graph = train_moe(comm, d, true, steps);
  });
  CHECK(eager.losses.back() < eager.losses.front());
  CHECK(graph.losses == eager.losses);  // bitwise
  REQUIRE(graph.params.size() == eager.params.size());
  for (size_t i = 0; i < eager.params.size(); ++i) CHECK(at::equal(graph.params[i], eager.params[i]));
  MESSAGE("small MoE step, 1 GPU: eager " << eager.step_ms << " ms, graph replay " << graph.step_ms << " ms ("
                                          << eager.step_ms / graph.step_ms << "x)");
}
