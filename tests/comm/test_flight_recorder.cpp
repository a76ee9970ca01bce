// Flight records: what is recorded, and the analysis that names a culprit.
#include <atomic>
#include <fstream>
#include <thread>
#include <nlohmann/json.hpp>

#include "../../src/comm/backend.hpp"
#include "fsdpp/comm/flight_recorder.hpp"
#include "comm/ranks.hpp"

using namespace fsdpp;

TEST_CASE("operations are recorded with sequence, sizes, label and state") {
  test::run_ranks(2, [](comm::Comm& comm) {
    {
      comm::OpLabel label("fsdp all_gather layers.0");
      comm.all_gather(at::empty({6}), at::ones({3})).wait();
    }
    comm.all_reduce(at::ones({5}, at::kDouble)).wait();
    auto sub = comm.split(0, comm.rank());
    sub.barrier().wait();
    const auto j = nlohmann::json::parse(comm.recorder()->to_json());
    CHECK(j["comm"] == "world");
    REQUIRE(j["entries"].size() == 2);
    CHECK(j["entries"][0]["op"] == "all_gather");
    CHECK(j["entries"][0]["in"] == 3);
    CHECK(j["entries"][0]["out"] == 6);
    CHECK(j["entries"][0]["label"] == "fsdp all_gather layers.0");
    CHECK(j["entries"][0]["state"] == "completed");
    CHECK(j["entries"][1]["dtype"] == "Double");
    CHECK(j["entries"][1]["seq"] == 1);
    CHECK(nlohmann::json::parse(sub.recorder()->to_json())["comm"] == "world/split0.0");
  });
}

TEST_CASE(
    "a one-rank collective completes as it is issued, with no state to allocate, and is recorded with its "
    "times") {
  test::run_ranks(1, [](comm::Comm& comm) {
    using namespace std::chrono;
    auto micros_now = [] {
      return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
    };
    const auto in = at::arange(6, at::kFloat);
    auto out = at::zeros({6});
    const int64_t before = micros_now();
    comm::Work work;
    {
      comm::OpLabel label("fsdp reduce_scatter layers.0");
      work = comm.reduce_scatter(out, in, {comm::ReduceOp::kSum});
    }
    const int64_t after = micros_now();
    CHECK(work.state() == nullptr);  // an empty Work: completed, nothing allocated for it
    CHECK(work.is_completed());
    work.wait();
    CHECK(out.equal(in));
    const auto j = nlohmann::json::parse(comm.recorder()->to_json());
    REQUIRE(j["entries"].size() == 1);
    const auto& e = j["entries"][0];
    CHECK(e["op"] == "reduce_scatter");
    CHECK(e["label"] == "fsdp reduce_scatter layers.0");
    CHECK(e["state"] == "completed");
    REQUIRE(e.contains("completed_us"));
    CHECK(e["started_us"] == e["issued_us"]);
    CHECK(e["issued_us"].get<int64_t>() >= before);
    CHECK(e["completed_us"].get<int64_t>() >= e["issued_us"].get<int64_t>());
    CHECK(e["completed_us"].get<int64_t>() <= after);
  });
}

TEST_CASE("a full recorder keeps its newest operations, oldest first") {
  comm::FlightRecorder recorder("ring", 0, 1, 3);
  const auto t = at::ones({2, 3}, at::kHalf);
  // Labels of both lengths, so that reused entries go from short to long ones and back.
  auto label_of = [](int i) {
    return i % 2 ? "odd " + std::to_string(i)
                 : "even, longer than a short string's buffer " + std::to_string(i);
  };
  for (int i = 0; i < 7; ++i) {
    comm::OpLabel label(label_of(i));
    recorder.record(i % 2 ? "all_gather" : "reduce_scatter", &t, nullptr, i, comm::Work());
  }
  const auto j = nlohmann::json::parse(recorder.to_json());
  REQUIRE(j["entries"].size() == 3);
  for (int k = 0; k < 3; ++k) {
    const int i = 4 + k;
    const auto& e = j["entries"][k];
    CHECK(e["seq"] == i);
    CHECK(e["peer"] == i);
    CHECK(e["op"] == (i % 2 ? "all_gather" : "reduce_scatter"));
    CHECK(e["label"] == label_of(i));
    CHECK(e["dtype"] == "Half");
    CHECK(e["in"] == 6);
    CHECK(e["out"] == 0);
  }
}

TEST_CASE("an operation waiting for a peer is started; the ones behind it are queued") {
  test::run_ranks(2, [](comm::Comm& comm) {
    if (comm.rank() == 1) {
      // Arrive late, so that rank 0's first all-reduce waits and its second sits in the queue.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm.all_reduce(at::ones({4})).wait();
      comm.all_reduce(at::ones({4})).wait();
      return;
    }
    auto a = comm.all_reduce(at::ones({4})), b = comm.all_reduce(at::ones({4}));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto j = nlohmann::json::parse(comm.recorder()->to_json());
    CHECK(j["entries"][0]["state"] == "started");
    CHECK(j["entries"][0].contains("started_us"));
    CHECK(j["entries"][1]["state"] == "queued");
    CHECK_FALSE(j["entries"][1].contains("started_us"));
    a.wait();
    b.wait();
    j = nlohmann::json::parse(comm.recorder()->to_json());
    CHECK(j["entries"][1]["state"] == "completed");
    CHECK(j["entries"][1]["completed_us"].get<int64_t>() >= j["entries"][1]["started_us"].get<int64_t>());
  });
}

namespace {

void write_dump(const std::string& dir, int rank, const std::vector<std::pair<std::string, int64_t>>& ops) {
  nlohmann::json entries = nlohmann::json::array();
  int64_t seq = 0;
  for (const auto& [label, n] : ops)
    entries.push_back({{"seq", seq++},
                       {"op", "all_gather"},
                       {"dtype", "Float"},
                       {"in", n},
                       {"out", 4 * n},
                       {"peer", -1},
                       {"label", label},
                       {"state", "completed"},
                       {"issued_us", 0}});
  nlohmann::json d = {{"rank", rank},
                      {"comms", {{{"comm", "world"}, {"rank", rank}, {"size", 4}, {"entries", entries}}}}};
  std::ofstream(dir + "/rank" + std::to_string(rank) + ".json") << d.dump();
}

}  // namespace

TEST_CASE("analysis names the rank that skipped an operation, or both sides of a mismatch") {
  const auto dir = test::fresh_store_path() + "-fr";
  std::filesystem::create_directories(dir);
  for (int r = 0; r < 4; ++r)
    write_dump(dir, r,
               r == 1 ? std::vector<std::pair<std::string, int64_t>>{{"layers.0", 8}}
                      : std::vector<std::pair<std::string, int64_t>>{{"layers.0", 8}, {"layers.1", 8}});
  bool found = false;
  auto report = comm::analyze_flight_records(dir, &found);
  INFO(report);
  CHECK(found);
  CHECK(report.find("rank(s) 1 never issued operation 1, which rank(s) 0, 2, 3 issued: all_gather Float in=8 "
                    "out=32 ('layers.1')") != std::string::npos);
  for (int r = 0; r < 4; ++r) write_dump(dir, r, {{"layers.0", r == 2 ? 9 : 8}});
  report = comm::analyze_flight_records(dir, &found);
  CHECK(report.find("at operation 0, rank(s) 2 issued all_gather Float in=9 out=36 ('layers.0') where "
                    "rank(s) 0, 1, 3 issued all_gather Float in=8") != std::string::npos);
  for (int r = 0; r < 4; ++r) write_dump(dir, r, {{"layers.0", 8}});
  report = comm::analyze_flight_records(dir, &found);
  CHECK_FALSE(found);
  CHECK(report.find("no disagreement") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("consistency check: ranks issuing different collectives fail at once, naming both sides") {
  test::run_ranks(3, [](comm::Comm& comm) {
    comm.set_consistency_check(true);
    auto t = at::ones({4});
    comm.all_reduce(t).wait();  // the same everywhere: passes
    CHECK(t[0].item<float>() == 3);
    std::string msg;
    try {
      // Rank 2 gathers 5 elements where the others gather 4.
      const int64_t n = comm.rank() == 2 ? 5 : 4;
      comm.all_gather(at::empty({3 * n}), at::ones({n})).wait();
    } catch (const comm::CommError& e) {
      msg = e.what();
    }
    INFO(msg);
    if (comm.rank() == 2)
      CHECK(
          msg.find(
              "this rank issues all_gather Float in=5 out=15, rank 0 issues all_gather Float in=4 out=12") !=
          std::string::npos);
    else
      CHECK(
          msg.find(
              "this rank issues all_gather Float in=4 out=12, rank 2 issues all_gather Float in=5 out=15") !=
          std::string::npos);
    // Nothing was sent: the communicator still works.
    comm.barrier().wait();
  });
}

TEST_CASE("an operation done for the host but not on the device is in flight until the device says so") {
  // What the NCCL backend hands back: a Work finished at enqueue, whose completion the device
  // reports through device_done (an event query there; a flag here).
  auto state = std::make_shared<comm::detail::WorkState>("rank 0/1 all_reduce Float n=4");
  auto on_device = std::make_shared<std::atomic<bool>>(false);
  state->device_done = [on_device] { return on_device->load(); };
  state->start();
  state->finish();
  const comm::Work work(state);
  comm::FlightRecorder recorder("world", 0, 1, 16);
  const auto t = at::ones({4});
  recorder.record("all_reduce", &t, &t, -1, work);

  CHECK_FALSE(work.is_completed());
  CHECK(nlohmann::json::parse(recorder.to_json())["entries"][0]["state"] == "started");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(recorder.overdue(std::chrono::milliseconds(10)).find("world seq 0 all_reduce") != std::string::npos);
  work.wait();  // done for the host: returns

  on_device->store(true);
  CHECK(work.is_completed());
  CHECK(nlohmann::json::parse(recorder.to_json())["entries"][0]["state"] == "completed");
  CHECK(recorder.overdue(std::chrono::milliseconds(10)).empty());

  // A failure found on the device afterwards (NCCL's asynchronous error) reaches wait().
  state->fail(std::make_exception_ptr(comm::CommError("NCCL error 'remote process exited'")));
  const auto msg = test::error_of([&] { work.wait(); });
  CHECK(msg.find("rank 0/1 all_reduce Float n=4 failed: NCCL error 'remote process exited'") !=
        std::string::npos);
  CHECK(nlohmann::json::parse(recorder.to_json())["entries"][0]["state"] == "failed");
}

TEST_CASE("the watchdog's abort hooks all run") {
  int runs = 0;
  comm::detail::add_abort_hook([&] { ++runs; });
  comm::detail::add_abort_hook([&] { runs += 10; });
  comm::detail::run_abort_hooks();
  CHECK(runs == 11);
}
