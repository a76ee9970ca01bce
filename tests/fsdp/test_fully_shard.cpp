// fully_shard: equivalence with unsharded training, collectives, mechanics, bad use.
#include "fsdpp/fsdp/adamw.hpp"
#include "fsdpp/fsdp/checkpoint.hpp"
#include "fsdp/models.hpp"
#include "fsdpp/base/files.hpp"

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <tuple>

using namespace fsdpp;
using test::Net;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kBatch = 12;  // divides evenly over 1-4 ranks

struct Data {
  at::Tensor x, y;
};

Data make_data() {
  auto g = at::detail::createCPUGenerator(1234);
  return {at::randn({kBatch, 5}, g), at::randn({kBatch, 3}, g)};
}

Net make_reference() {
  auto net = Net(8, 3);
  auto g = at::detail::createCPUGenerator(7);
  at::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(at::randn(p.sizes(), g) * 0.3);
  return net;
}

struct Trace {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> params;
};

// Plain LibTorch: the whole batch in one process, `micro` microbatches per step.
Trace train_reference(int micro) {
  auto net = make_reference();
  const auto data = make_data();
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  Trace t;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    double loss_sum = 0;
    for (int m = 0; m < micro; ++m) {
      const int64_t mb = kBatch / micro;
      auto loss = at::mse_loss(net->forward(data.x.narrow(0, m * mb, mb)), data.y.narrow(0, m * mb, mb));
      (loss / micro).backward();
      loss_sum += loss.item<double>() / micro;
    }
    opt.step();
    t.losses.push_back(loss_sum);
  }
  for (auto& p : net->named_parameters()) t.params.emplace_back(p.key(), p.value().detach().clone());
  return t;
}

// Sharded over comm: each rank takes its slice of the batch; `micro` microbatches, all but the last
// without gradient sync.
// `data_comm`: the ranks the batch is split over, when they are not just `comm`'s (HSDP).
Trace train_sharded(comm::Comm& comm, int micro, fsdp::FullyShardOptions options = {},
                    comm::Comm* data_comm = nullptr) {
  auto ref = make_reference();
  auto net = Net(8, 3);
  test::copy_params(*net, *ref);
  auto model = fsdp::fully_shard(net, comm, options);
  const auto data = make_data();
  comm::Comm& dp = data_comm ? *data_comm : comm;
  const int64_t local = kBatch / dp.size();
  const auto x = data.x.narrow(0, dp.rank() * local, local);
  const auto y = data.y.narrow(0, dp.rank() * local, local);
  torch::optim::AdamW opt(model->sharded_parameters(), torch::optim::AdamWOptions(1e-2));
  Trace t;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    double loss_sum = 0;
    for (int m = 0; m < micro; ++m) {
      model->set_requires_gradient_sync(m == micro - 1);
      const int64_t mb = local / micro;
      auto loss = at::mse_loss(model->forward(x.narrow(0, m * mb, mb)), y.narrow(0, m * mb, mb));
      (loss / micro).backward();
      loss_sum += loss.item<double>() / micro;
    }
    opt.step();
    auto l = at::full({1}, loss_sum, at::kDouble);
    dp.all_reduce(l, {comm::ReduceOp::kAvg}).wait();
    t.losses.push_back(l.item<double>());
  }
  t.params = fsdp::full_state_dict(*model.ptr());
  return t;
}

void check_same(const Trace& got, const Trace& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    INFO("step " << i << ": " << got.losses[i] << " vs " << want.losses[i]);
    CHECK(std::abs(got.losses[i] - want.losses[i]) <= 1e-5 * std::abs(want.losses[i]));
  }
  std::map<std::string, at::Tensor> by_name(got.params.begin(), got.params.end());
  REQUIRE(by_name.size() == want.params.size());
  for (const auto& [name, value] : want.params) {
    INFO(name);
    REQUIRE(by_name.count(name) == 1);
    CHECK(by_name[name].sizes().vec() == value.sizes().vec());
    CHECK(test::rel_diff(by_name[name], value) < 1e-5);
  }
}

}  // namespace

TEST_CASE("10 AdamW steps sharded over 1-4 ranks match plain LibTorch") {
  const auto want = train_reference(1);
  CHECK(want.losses.back() < want.losses.front());  // it trains
  for (int n = 1; n <= 4; ++n)
    test::run_ranks(
        n, [&](comm::Comm& comm) { check_same(train_sharded(comm, 1), want, "world " + std::to_string(n)); });
}

TEST_CASE("gradient accumulation with no-sync microbatches matches too") {
  const auto want = train_reference(1);  // same gradients: the microbatches average to the batch
  for (int n : {2, 3})
    test::run_ranks(n, [&](comm::Comm& comm) {
      check_same(train_sharded(comm, 2), want, "world " + std::to_string(n) + ", 2 microbatches");
    });
}

TEST_CASE(
    "HSDP: sharded within groups of 2 and replicated across 2 groups, 10 AdamW steps match plain LibTorch") {
  const auto want = train_reference(1);
  for (int micro : {1, 3})  // 3 samples per rank: 1 or 3 microbatches
    test::run_ranks(4, [&](comm::Comm& world) {
      // Groups of consecutive ranks {0, 1} and {2, 3}; replicas {0, 2} and {1, 3}.
      auto shard = world.split(world.rank() / 2, world.rank() % 2);
      auto replicas = world.split(world.rank() % 2, world.rank() / 2);
      fsdp::FullyShardOptions o;
      o.replicate = replicas;
      check_same(train_sharded(shard, micro, o, &world), want,
                 "HSDP 2 x 2, " + std::to_string(micro) + " microbatches");
    });
}

// Note [one-rank buffers]: each rank alone in its shard group, the average over the replicas alone.
TEST_CASE(
    "HSDP: shard groups of one rank replicated across 2 (data parallel), 10 AdamW steps match plain "
    "LibTorch") {
  const auto want = train_reference(1);
  for (int micro : {1, 3})  // 6 samples per rank: 1 or 3 microbatches
    test::run_ranks(2, [&](comm::Comm& world) {
      auto alone = world.split(world.rank(), 0);
      fsdp::FullyShardOptions o;
      o.replicate = world.split(0, world.rank());
      check_same(train_sharded(alone, micro, o, &world), want,
                 "HSDP 1 x 2, " + std::to_string(micro) + " microbatches");
    });
}

TEST_CASE("HSDP: the first replica group saves the one copy, which loads at another layout") {
  const auto dir = test::fresh_store_path() + "-hsdp";
  test::run_ranks(4, [&](comm::Comm& world) {
    auto shard = world.split(world.rank() / 2, world.rank() % 2);
    fsdp::FullyShardOptions o;
    o.replicate = world.split(world.rank() % 2, world.rank() / 2);
    auto net = Net(8, 3);
    test::copy_params(*net, *make_reference());
    auto model = fsdp::fully_shard(net, shard, o);
    fsdp::save_sharded(*model.ptr(), dir);
  });
  CHECK(std::filesystem::exists(dir + "/rank1.json"));
  CHECK_FALSE(std::filesystem::exists(dir + "/rank2.json"));
  const auto want = make_reference()->named_parameters();
  test::run_ranks(3, [&](comm::Comm& comm) {
    auto model = fsdp::fully_shard(Net(8, 3), comm);
    fsdp::load_sharded(*model.ptr(), dir);
    for (const auto& [name, value] : fsdp::full_state_dict(*model.ptr())) {
      INFO(name);
      CHECK(value.equal(want[name]));
    }
  });
  std::filesystem::remove_all(dir);
}

TEST_CASE("overlap off, reshard_after_forward off: same results") {
  const auto want = train_reference(1);
  test::run_ranks(3, [&](comm::Comm& comm) {
    fsdp::FullyShardOptions o;
    o.overlap_reduce_scatter = false;
    o.reshard_after_forward = false;
    check_same(train_sharded(comm, 1, o), want, "no overlap, no reshard");
  });
}

namespace {

// One AdamW step on this rank's slice of the batch; returns the loss averaged over ranks.
double train_step(fsdp::FullyShard<test::NetImpl>& model, fsdp::AdamW& opt, comm::Comm& comm,
                  const Data& data) {
  const int64_t local = kBatch / comm.size();
  opt.zero_grad();
  auto loss = at::mse_loss(model->forward(data.x.narrow(0, comm.rank() * local, local)),
                           data.y.narrow(0, comm.rank() * local, local));
  loss.backward();
  opt.step();
  auto l = at::full({1}, loss.item<double>(), at::kDouble);
  comm.all_reduce(l, {comm::ReduceOp::kAvg}).wait();
  return l.item<double>();
}

}  // namespace

TEST_CASE("a sharded checkpoint saved at 4 ranks resumes at 2 and 3 with the same losses") {
  const auto dir = test::fresh_store_path() + "-ckpt";
  const auto data = make_data();
  std::vector<double> uninterrupted;
  test::run_ranks(4, [&](comm::Comm& comm) {
    auto net = Net(8, 3);
    test::copy_params(*net, *make_reference());
    auto model = fsdp::fully_shard(net, comm);
    fsdp::AdamW opt(model->sharded_parameters(), {.lr = 1e-2});
    for (int s = 0; s < 3; ++s) train_step(model, opt, comm, data);
    fsdp::save_sharded(*model.ptr(), dir, &opt);
    std::vector<double> losses;
    for (int s = 0; s < 3; ++s) losses.push_back(train_step(model, opt, comm, data));
    if (comm.rank() == 0) uninterrupted = losses;
  });
  for (int n : {2, 3})
    test::run_ranks(n, [&](comm::Comm& comm) {
      auto model = fsdp::fully_shard(Net(8, 3), comm);  // fresh weights, replaced by the load
      fsdp::AdamW opt(model->sharded_parameters(), {.lr = 1e-2});
      fsdp::load_sharded(*model.ptr(), dir, &opt);
      for (int s = 0; s < 3; ++s) {
        const double loss = train_step(model, opt, comm, data);
        INFO("world " << n << " step " << s << ": " << loss << " vs " << uninterrupted[s]);
        CHECK(std::abs(loss - uninterrupted[s]) <= 1e-5 * std::abs(uninterrupted[s]));
      }
    });
  std::filesystem::remove_all(dir);
}

TEST_CASE("a checkpoint with a missing rank file is rejected naming the file") {
  const auto dir = test::fresh_store_path() + "-ckpt";
  test::run_ranks(2, [&](comm::Comm& comm) {
    auto model = fsdp::fully_shard(Net(8, 1), comm);
    fsdp::save_sharded(*model.ptr(), dir);
  });
  std::filesystem::remove(dir + "/rank1.json");
  test::run_ranks(1, [&](comm::Comm& comm) {
    auto model = fsdp::fully_shard(Net(8, 1), comm);
    std::string msg;
    try {
      fsdp::load_sharded(*model.ptr(), dir);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    CHECK(msg.find("rank1.json is missing") != std::string::npos);
  });
  std::filesystem::remove_all(dir);
}

namespace {

// What read_full_parameters says of `dir` once its rank-0 index is `index` ("" when it reads).
std::string read_error(const std::string& dir, const nlohmann::json& index) {
  fsdpp::write_file_atomically(dir + "/rank0.json", index.dump());
  try {
    fsdp::read_full_parameters(dir);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE(
    "a checkpoint index whose numbers are floats, strings or out of range is rejected naming the field") {
  const auto dir = test::fresh_store_path() + "-ckpt";
  test::run_ranks(1, [&](comm::Comm& comm) {
    auto model = fsdp::fully_shard(Net(8, 1), comm);
    fsdp::save_sharded(*model.ptr(), dir);
  });
  const auto good = fsdpp::read_json_file(dir + "/rank0.json");
  const std::vector<std::tuple<std::string, nlohmann::json, std::string>> damage = {
      {"rows", 6.6e62, "'rows'"},
      {"rows", "4", "'rows'"},
      {"row_offset", 0.5, "'row_offset'"},
      {"row_offset", uint64_t(1) << 63, "'row_offset'"},
      {"shape", nlohmann::json::array({-8, 5}), "'shape'"},
      {"shape", nlohmann::json::array({8.0, 5}), "'shape'"},
  };
  for (const auto& [key, value, want] : damage) {
    auto index = good;
    index["entries"][0][key] = value;
    const auto msg = read_error(dir, index);
    INFO(key << " = " << value.dump() << ": " << msg);
    CHECK(msg.find(want) != std::string::npos);
  }
  fsdpp::write_file_atomically(dir + "/rank0.json", good.dump());
  CHECK(!fsdp::read_full_parameters(dir).empty());
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "a checkpoint index claiming a shape its rows do not fill is rejected before anything is allocated") {
  const auto dir = test::fresh_store_path() + "-ckpt";
  test::run_ranks(1, [&](comm::Comm& comm) {
    auto model = fsdp::fully_shard(Net(8, 1), comm);
    fsdp::save_sharded(*model.ptr(), dir);
  });
  const auto good = fsdpp::read_json_file(dir + "/rank0.json");
  size_t k = 0;  // a matrix
  while (good["entries"][k]["shape"].size() != 2) ++k;
  const auto rows = good["entries"][k]["shape"][0].get<int64_t>();
  const auto cols = good["entries"][k]["shape"][1].get<int64_t>();
  // Found by fuzzing: a first dimension of 455555555555 made the reader allocate 5.4 TB.
  const std::vector<nlohmann::json> shapes = {
      nlohmann::json::array({int64_t{455555555555}, cols}), nlohmann::json::array({rows + 1, cols}),
      nlohmann::json::array({rows, cols + 1}), nlohmann::json::array({rows, cols, 1}),
      nlohmann::json::array()};
  for (const auto& shape : shapes) {
    auto index = good;
    index["entries"][k]["shape"] = shape;
    const auto msg = read_error(dir, index);
    INFO("shape " << shape.dump() << ": " << msg);
    CHECK(msg.find("'" + good["entries"][k]["name"].get<std::string>() + "'") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "a damaged byte in a checkpoint's tensor data, or a cut-short file, is found by its checksum, naming the "
    "file") {
  const auto dir = test::fresh_store_path() + "-ckpt";
  test::run_ranks(2, [&](comm::Comm& comm) {
    auto model = fsdp::fully_shard(Net(8, 1), comm);
    fsdp::save_sharded(*model.ptr(), dir);
  });
  const auto file = dir + "/rank1.safetensors";
  std::string original;
  {
    std::ifstream in(file, std::ios::binary);
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto error_of = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto write = [&](const std::string& bytes) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  };
  CHECK(error_of([&] { fsdp::verify_sharded(dir); }) == "no error");
  // One bit of the last tensor's last byte: a valid file with a wrong number, which only the
  // checksum can tell.
  auto flipped = original;
  flipped.back() ^= 0x01;
  write(flipped);
  for (const auto& msg :
       {error_of([&] { fsdp::verify_sharded(dir); }), error_of([&] { fsdp::read_full_parameters(dir); })}) {
    CHECK(msg.find(file + " is damaged: its CRC-32C is ") != std::string::npos);
    CHECK(msg.find("rank1.json records") != std::string::npos);
  }
  test::run_ranks(2, [&](comm::Comm& comm) {
    auto model = fsdp::fully_shard(Net(8, 1), comm);
    CHECK(error_of([&] { fsdp::load_sharded(*model.ptr(), dir); }).find(file + " is damaged") !=
          std::string::npos);
  });
  write(original.substr(0, original.size() - 4));
  CHECK(error_of([&] {
          fsdp::verify_sharded(dir);
        }).find(file + " is " + std::to_string(original.size() - 4) + " bytes, but") != std::string::npos);
  write(original);
  CHECK(error_of([&] { fsdp::verify_sharded(dir); }) == "no error");
  std::filesystem::remove_all(dir);
}

TEST_CASE("reshard_after_forward as a group size: backward gathers within groups of 2 of 4 ranks") {
  const auto want = train_reference(1);
  test::run_ranks(4, [&](comm::Comm& comm) {
    fsdp::FullyShardOptions o;
    o.reshard_after_forward = 2;
    check_same(train_sharded(comm, 1, o), want, "reshard_after_forward=2");
  });
  test::run_ranks(2, [&](comm::Comm& comm) {
    fsdp::FullyShardOptions o;
    o.reshard_after_forward = 3;  // does not divide 2
    std::string msg;
    try {
      fsdp::fully_shard(Net(8, 1), comm, o);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    CHECK(msg.find("reshard_after_forward=3 must be a positive divisor of the world size 2") !=
          std::string::npos);
  });
}
