// The GPU path, on the GPUs of the machine (built only against a CUDA LibTorch; scripts/gpu-check.sh
// runs it): NCCL through comm::Comm, fully_shard on CUDA against the unsharded model on the CPU,
// and a step captured as a CUDA graph against the same step run eagerly.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <doctest/doctest.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "fsdpp/comm/flight_recorder.hpp"
#include "fsdpp/comm/init.hpp"
#include "fsdpp/comm/store.hpp"
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdp/models.hpp"
#include "gpu/collectives.hpp"
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

TEST_CASE("NCCL through comm::Comm: every operation on CUDA tensors, float32 and bfloat16") {
  REQUIRE(gpus() >= 1);
  const int n = std::min(2, gpus());
  MESSAGE("world size " << n << " (" << gpus() << " GPUs; world 2 on one GPU runs as processes: gpu_ranks)");
  run_nccl_ranks(n, [](comm::Comm& comm, int d) {
    for (const auto& failure :
         test::check_collectives(comm, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d))))
      FAIL_CHECK(failure);
  });
}

// Note [captured operations] in nccl_core.hpp: the watchdog polls every operation's completion
// every 100 ms. An operation recorded during a capture must not be queried as if it had run.
TEST_CASE("after a captured step, the watchdog leaves the communicator alone and records nothing overdue") {
  REQUIRE(gpus() >= 1);
  const auto dumps = std::filesystem::temp_directory_path() / fmt::format("fsdpp-gpu-watchdog-{}", getpid());
  std::filesystem::remove_all(dumps);
  run_nccl_ranks(1, [&](comm::Comm& comm, int d) {
    comm::WatchdogOptions w;
    w.timeout = std::chrono::milliseconds(500);
    w.dump_dir = dumps.string();
    w.exit_code = 0;  // dump only: the test reads what it did
    comm::start_watchdog(w);
    auto t = at::ones({1024}, on(d));
    auto body = [&] {
      t.mul_(2);
      comm.all_reduce(t).wait();
      auto g = at::empty({1024}, on(d));
      comm.all_gather(g, t).wait();
      t.copy_(g);
    };
    CapturedStep::warm_up(body);  // eager: the communicator's buffers exist before the capture
    auto step = CapturedStep::capture(body);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));  // several polls after the capture
    for (int i = 0; i < 3; ++i) step->replay();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto after = at::full({3}, 5.0, on(d));
    comm.all_reduce(after).wait();  // throws if the watchdog's query aborted the communicator
    CHECK(at::equal(after.cpu(), at::full({3}, 5.0)));
    CHECK(at::equal(t.cpu(), at::full({1024}, 16.0)));  // eager 2, three replays 16
    const auto records = nlohmann::json::parse(comm.recorder()->to_json());
    for (const auto& e : records["entries"]) CHECK_MESSAGE(e["state"] == "completed", e.dump());
    comm::stop_watchdog();
  });
  CHECK_MESSAGE(!std::filesystem::exists(dumps), "the watchdog dumped flight records to " << dumps);
}

// Note [a failed capture] in cuda_graph.cpp.
TEST_CASE(
    "a failed capture leaves the allocator and the generators usable: eager work and a later capture run") {
  REQUIRE(gpus() >= 1);
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const int d = 0;
  c10::cuda::set_device(d);
  auto x = at::arange(4096, on(d));
  c10::cuda::device_synchronize();
  alloc::emptyCache();
  const auto reserved = [&] { return alloc::getDeviceStats(d).reserved_bytes[0].current; };
  const int64_t before = reserved();
  std::string error;
  try {
    CapturedStep::capture([&] {
      auto y = at::empty({1 << 20}, on(d));  // from the graph's pool
      y.fill_(1);
      (void)y.sum().item<float>();  // a host read: the capture refuses it
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  CHECK_MESSAGE(error.find("CUDA graph capture of the step failed") != std::string::npos, error);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK_FALSE(stream_capturing(d));
  // The failed capture's pool is gone and the allocator routes nothing there any more.
  CHECK(reserved() <= before);
  auto z = x * 2;  // eager work on the caller's stream and on a side stream
  {
    c10::cuda::CUDAStreamGuard g(c10::cuda::getStreamFromPool());
    auto w = at::ones({1 << 16}, on(d)).cumsum(0);
    CHECK(w[-1].item<float>() == float(1 << 16));
  }
  CHECK(z[4095].item<float>() == 8190.0f);
  // The CUDA generators left capture mode: seeding works and the draws repeat.
  at::manual_seed(5);
  const auto drawn = at::rand({8}, on(d));
  at::manual_seed(5);
  CHECK(at::equal(drawn, at::rand({8}, on(d))));
  at::Tensor out;
  auto ok = CapturedStep::capture([&] { out = x * 3; });
  ok->replay();
  CHECK(out[4095].item<float>() == 12285.0f);
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
    const auto xl = x.narrow(0, comm.rank() * local, local).to(on(d)),
               yl = y.narrow(0, comm.rank() * local, local).to(on(d));
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
  // One batch, copied into the static inputs before every step: a model that trains memorises it,
  // so the loss falls (on fresh uniform tokens it need not).
  auto gen = at::detail::createCPUGenerator(500 + comm.rank());
  const auto data = at::randint(256, {B, T + 1}, gen);
  for (int s = 0; s < steps; ++s) {
    x.copy_(data.narrow(1, 0, T));
    yt.copy_(data.narrow(1, 1, T));
    opt.set_lr(3e-3 * (1.0 - 0.9 * s / steps));  // linear decay to a tenth, positive throughout
    c10::cuda::device_synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    if (graph && s >= 3) {
      if (!captured) captured = CapturedStep::capture(body);
      captured->replay();
    } else if (graph) {
      CapturedStep::warm_up(body);
    } else {
      body();
    }
    c10::cuda::device_synchronize();
    if (s >= 5)
      times.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
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
  CHECK(eager.losses.back() < eager.losses.front());  // the one batch is being learnt (train_moe)
  CHECK(graph.losses == eager.losses);                // bitwise
  REQUIRE(graph.params.size() == eager.params.size());
  for (size_t i = 0; i < eager.params.size(); ++i) CHECK(at::equal(graph.params[i], eager.params[i]));
  MESSAGE("small MoE step, 1 GPU: eager " << eager.step_ms << " ms, graph replay " << graph.step_ms << " ms ("
                                          << eager.step_ms / graph.step_ms << "x)");
}

TEST_CASE("packed samples and the published families' attention on CUDA: the CPU kernel's results") {
  REQUIRE(gpus() >= 1);
  models::MoEConfig c;
  c.dim = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_size = 12;  // Qwen3's wide heads, its q/k norms, Qwen2's biases, Mistral's window, Llama 3.1's rope
  c.qk_norm = "head";
  c.qkv_bias = true;
  c.sliding_window = 40;
  c.rope_type = "llama3";
  c.rope_factor = 8;
  c.rope_original_max_seq_len = 32;
  c.layers = 2;
  c.max_seq_len = 96;
  c.ffn_hidden = 48;
  c.experts = 4;
  c.expert_hidden = 16;
  c.vocab_size = 64;
  at::manual_seed(41);
  auto cpu = models::MoETransformer(c);
  auto gpu = models::MoETransformer(c);
  {
    at::NoGradGuard no_grad;
    const auto from = cpu->named_parameters();
    for (auto& p : gpu->named_parameters()) p.value().copy_(from[p.key()]);
  }
  gpu->to(at::Device(at::kCUDA, 0));
  // Two samples: three sequences (one crossing the CPU kernel's 64-row blocks), and one.
  std::vector<int64_t> pos;
  for (const int64_t n : {20, 50, 26, 96})
    for (int64_t t = 0; t < n; ++t) pos.push_back(t);
  const auto positions = at::tensor(pos, at::kLong).view({2, 96});
  const auto tokens = at::randint(c.vocab_size, {2, 96}, at::kLong);
  cpu->set_positions(positions);
  gpu->set_positions(positions.cuda());
  const auto want = cpu->forward(tokens);
  const auto got = gpu->forward(tokens.cuda());
  CHECK(at::allclose(got.cpu(), want, 1e-4, 1e-5));
  want.pow(2).mean().backward();
  got.pow(2).mean().backward();
  const auto cpu_grads = cpu->named_parameters();
  for (const auto& p : gpu->named_parameters()) {
    CAPTURE(p.key());
    CHECK(at::allclose(p.value().grad().cpu(), cpu_grads[p.key()].grad(), 1e-3, 1e-5));
  }
}
