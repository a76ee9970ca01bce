// ThreadTeam: every member runs at once on its own thread (member 0 on the caller), again and again
// on the same threads, and the lowest-numbered member's exception reaches the caller after all
// have returned.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "fsdpp/base/thread_team.hpp"

using namespace fsdpp;

TEST_CASE("thread team: members run at once, each on its own thread, the same threads every round") {
  ThreadTeam team(3);
  CHECK(team.size() == 3);
  std::vector<std::set<std::thread::id>> ids(3);
  for (int round = 0; round < 4; ++round) {
    std::atomic<int> arrived{0};
    std::vector<int> ran(3, 0), met(3, 0);
    team.run([&](int i) {
      ids[i].insert(std::this_thread::get_id());
      ++ran[i];
      // Every member waits here for the others: run one after the other, none would meet them.
      ++arrived;
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (arrived.load() < 3 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
      met[i] = arrived.load() == 3;
    });
    CHECK(ran == std::vector<int>{1, 1, 1});
    CHECK(met == std::vector<int>{1, 1, 1});
  }
  CHECK(ids[0] == std::set<std::thread::id>{std::this_thread::get_id()});
  for (int i = 1; i < 3; ++i) {
    CAPTURE(i);
    CHECK(ids[i].size() == 1);  // one thread for all four rounds
    CHECK(*ids[i].begin() != std::this_thread::get_id());
  }
  CHECK(*ids[1].begin() != *ids[2].begin());
}

TEST_CASE("thread team: the lowest-numbered member's exception comes back after every member returned") {
  ThreadTeam team(3);
  std::atomic<int> returned{0};
  try {
    team.run([&](int i) {
      if (i == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        ++returned;
        throw std::runtime_error("member 2");
      }
      if (i == 1) {
        ++returned;
        throw std::runtime_error("member 1");
      }
      ++returned;
    });
    FAIL("run returned normally");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "member 1");
  }
  CHECK(returned.load() == 3);
  // The team is still usable.
  std::atomic<int> sum{0};
  team.run([&](int i) { sum += i + 1; });
  CHECK(sum.load() == 6);
  CHECK_THROWS_WITH_AS(ThreadTeam(0), "ThreadTeam: size must be at least 1, got 0", std::invalid_argument);
}
