#pragma once
// Runs a function on N ranks, each a thread with its own communicator, over real Gloo on
// loopback, rendezvousing through a fresh file store.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fsdpp/comm/init.hpp"

namespace fsdpp::test {

inline std::string fresh_store_path() {
  static std::atomic<int> counter{0};
  auto dir = std::filesystem::temp_directory_path();
  return (dir / ("fsdpp-test-" + std::to_string(getpid()) + "-" + std::to_string(counter++))).string();
}

// Runs `body` on n ranks, each a thread whose communicator `connect(rank, store_path)` makes;
// a rank that throws fails the test, naming the rank.
inline void run_rank_threads(
    int n, const std::function<comm::Comm(int rank, const std::string& store_path)>& connect,
    const std::function<void(comm::Comm&)>& body) {
  const auto path = fresh_store_path();
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = connect(r, path);
        body(comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  std::filesystem::remove(path);
  for (int r = 0; r < n; ++r)
    if (errors[r]) {
      try {
        std::rethrow_exception(errors[r]);
      } catch (const std::exception& e) {
        FAIL("rank " << r << " of " << n << " threw: " << std::string(e.what()));
      } catch (...) {
        FAIL("rank " << r << " of " << n << " stopped at a failed REQUIRE (see above)");
      }
    }
}

inline void run_ranks(int n, const std::function<void(comm::Comm&)>& body,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  run_rank_threads(
      n,
      [&](int r, const std::string& path) {
        comm::InitOptions opts;
        opts.timeout = timeout;
        return comm::connect(comm::make_file_store(path, n, timeout), r, n, opts);
      },
      body);
}

// The message of what f throws, or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

inline const std::vector<at::ScalarType>& all_dtypes() {
  static const std::vector<at::ScalarType> v = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                                at::kInt,   at::kLong,   at::kByte};
  return v;
}

}  // namespace fsdpp::test
