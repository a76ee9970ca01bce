// Rendezvous failures: each must fail within the timeout with a message that says what is wrong.
#include "comm/ranks.hpp"

using namespace fsdpp;

TEST_CASE("a rank that never joins makes the others fail at init, naming it") {
  const auto path = test::fresh_store_path();
  comm::InitOptions opts;
  opts.timeout = std::chrono::milliseconds(1500);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 2; ++r)  // world size 3, rank 2 never starts
    threads.emplace_back([&, r] {
      errors[r] = test::error_of([&] { comm::connect(comm::make_file_store(path, 3), r, 3, opts); });
    });
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::filesystem::remove(path);
  CHECK(secs < 10);
  for (int r = 0; r < 2; ++r) {
    INFO(errors[r]);
    CHECK(errors[r].find("rank " + std::to_string(r) + " of 3") != std::string::npos);
    CHECK(errors[r].find("2 of 3 ranks joined, missing rank(s) 2") != std::string::npos);
  }
}

TEST_CASE("ranks started with different world sizes are told so") {
  const auto path = test::fresh_store_path();
  comm::InitOptions opts;
  opts.timeout = std::chrono::milliseconds(3000);
  std::string e0, e1;
  // Rank 0 believes in 2 ranks, rank 1 in 3 (and rank 2 never comes).
  std::thread a(
      [&] { e0 = test::error_of([&] { comm::connect(comm::make_file_store(path, 2), 0, 2, opts); }); });
  std::thread b(
      [&] { e1 = test::error_of([&] { comm::connect(comm::make_file_store(path, 3), 1, 3, opts); }); });
  a.join();
  b.join();
  std::filesystem::remove(path);
  INFO(e0);
  CHECK(e0.find("rank 1") != std::string::npos);
  CHECK(e0.find("WORLD_SIZE=3, this rank with WORLD_SIZE=2") != std::string::npos);
  CHECK(e1.find("missing rank(s) 2") != std::string::npos);
}

TEST_CASE("a store address where nothing listens fails within the timeout, naming it") {
  comm::TcpStoreOptions so;
  so.host = "127.0.0.1";
  so.port = 1;  // privileged and unused here
  so.timeout = std::chrono::milliseconds(1000);
  const auto t0 = std::chrono::steady_clock::now();
  const auto msg = test::error_of([&] { comm::make_tcp_store(so); });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(msg);
  CHECK(msg.find("cannot reach the rendezvous store at 127.0.0.1:1") != std::string::npos);
  CHECK(secs < 10);
}

TEST_CASE("TCP store: a server on a free port and clients of it rendezvous") {
  comm::TcpStoreOptions so;
  so.is_server = true;
  auto server = comm::make_tcp_store(so);
  const auto port = comm::tcp_store_port(*server);
  CHECK(port > 0);
  std::vector<std::thread> threads;
  std::vector<double> got(3);
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      comm::TcpStoreOptions co;
      co.port = port;
      auto comm = comm::connect(comm::make_prefix_store("t", comm::make_tcp_store(co)), r, 3);
      auto t = at::full({2}, r + 1.0);
      comm.all_reduce(t).wait();
      got[r] = t[1].item<double>();
    });
  for (auto& t : threads) t.join();
  for (double v : got) CHECK(v == 6.0);
}

TEST_CASE("the launch environment is read and checked") {
  setenv("WORLD_SIZE", "4", 1);
  setenv("RANK", "4", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  CHECK(test::error_of([] { comm::read_launch_env(); }).find("RANK='4' is not an integer in [0, 3]") !=
        std::string::npos);
  setenv("RANK", "3", 1);
  unsetenv("LOCAL_RANK");
  unsetenv("LOCAL_WORLD_SIZE");
  auto env = comm::read_launch_env();
  CHECK(env.rank == 3);
  CHECK(env.local_rank == 3);
  CHECK(env.local_world_size == 4);
  unsetenv("MASTER_PORT");
  CHECK(test::error_of([] { comm::read_launch_env(); }).find("MASTER_PORT is not set") != std::string::npos);
  for (const char* k : {"WORLD_SIZE", "RANK", "MASTER_ADDR"}) unsetenv(k);
}
