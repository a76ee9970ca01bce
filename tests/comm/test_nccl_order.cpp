// The NCCL-order check (Note [NCCL order on the CPU] in src/comm/nccl_order.cpp): Gloo ranks under
// NCCL's ordering rules run what NCCL runs, the GPU check's own rank code included, and refuse
// what would hang on NCCL, naming every rank's operation in the cycle.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <map>
#include <mutex>

#include "comm/ranks.hpp"
#include "gpu/collectives.hpp"

using namespace fsdpp;

namespace {

void run_ordered(int n, const std::function<void(comm::Comm&)>& body,
                 std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  test::run_rank_threads(
      n,
      [&](int r, const std::string& path) {
        comm::InitOptions o;
        o.timeout = timeout;
        o.check_nccl_order = true;
        return comm::connect(comm::make_file_store(path, n, timeout), r, n, o);
      },
      body);
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// What the ring that the GPU check issued at 561725f does: receive from the left, then send to the
// right, each alone on one communicator.
void ring_recv_then_send(comm::Comm& comm) {
  const int r = comm.rank(), n = comm.size();
  auto got = at::empty({6});
  auto w = comm.recv(got, (r + n - 1) % n, 3);
  comm.send(at::full({6}, double(r)), (r + 1) % n, 3).wait();
  w.wait();
}

// Deadlocked ranks fail within seconds, but the Gloo operations left waiting underneath end only at
// the communicator's timeout, when the ranks tear down: keep it short.
constexpr auto kShort = std::chrono::seconds(6);

}  // namespace

TEST_CASE("NCCL order: the GPU check's collectives and its captured sequence run, at worlds 1 to 4") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<at::Tensor> checked(n), plain(n);
    const auto sequence = [&](std::vector<at::Tensor>& out) {
      return [&](comm::Comm& comm) {
        auto t = at::arange(8 * comm.size(), at::kFloat).add(comm.rank());
        for (int i = 0; i < 3; ++i) test::round_trip(comm, t);
        out[comm.rank()] = t;
      };
    };
    run_ordered(n, [&](comm::Comm& comm) {
      for (const auto& failure : test::check_collectives(comm, at::kCPU)) FAIL_CHECK(failure);
      sequence(checked)(comm);
    });
    test::run_ranks(n, sequence(plain));
    for (int r = 0; r < n; ++r) CHECK(at::equal(checked[r], plain[r]));
  }
}

TEST_CASE("NCCL order: a receive issued alone before the send it waits for hangs on NCCL, and is named") {
  // Plain Gloo runs it: its receives complete on a thread of their own.
  test::run_ranks(2, ring_recv_then_send);
  for (int n : {2, 3}) {
    CAPTURE(n);
    std::mutex mu;
    std::map<int, std::string> errors;
    run_ordered(
        n,
        [&](comm::Comm& comm) {
          const auto e = test::error_of([&] { ring_recv_then_send(comm); });
          std::lock_guard<std::mutex> lock(mu);
          errors[comm.rank()] = e;
        },
        kShort);
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r << ": " << errors[r]);
      CHECK(has(errors[r], "a wait that can never end"));
      for (int q = 0; q < n; ++q)
        CHECK(
            has(errors[r], fmt::format("rank {} waits at its operation 0 (recv from rank {} tag 3 Float n=6)",
                                       q, (q + n - 1) % n)));
      CHECK(has(errors[r], "batch_p2p"));
    }
  }
}

TEST_CASE("NCCL order: a receive queued before a collective holds it, as on an NCCL stream") {
  // Rank 0 receives and then joins the all-reduce; rank 1 all-reduces first and sends after. Gloo
  // lets the all-reduce pass the waiting receive (which also checks that a receive takes no tag
  // from the collectives after it); NCCL's stream does not.
  const auto program = [](comm::Comm& comm) {
    auto x = at::ones({4}), t = at::empty({2});
    if (comm.rank() == 0) {
      auto w = comm.recv(t, 1);
      comm.all_reduce(x).wait();
      w.wait();
    } else {
      comm.all_reduce(x).wait();
      comm.send(at::ones({2}), 0).wait();
    }
  };
  test::run_ranks(2, program);
  std::vector<std::string> errors(2);
  run_ordered(
      2, [&](comm::Comm& comm) { errors[comm.rank()] = test::error_of([&] { program(comm); }); }, kShort);
  for (const auto& e : errors) {
    INFO(e);
    CHECK(has(e, "rank 0 waits at its operation 0 (recv from rank 1 tag 0 Float n=2) for rank(s) 1"));
    CHECK(has(e, "rank 1 waits at its operation 0 (all_reduce Float sum n=4) for rank(s) 0"));
  }
}

TEST_CASE(
    "NCCL order: sends and receives pair by order, not by tag: a pair that differs fails on both sides") {
  // Rank 1 receives tag 2 first: Gloo matches by tag and delivers; NCCL would pair the first send
  // (tag 1) with it.
  const auto program = [](comm::Comm& comm) {
    auto a = at::empty({4}), b = at::empty({4});
    if (comm.rank() == 0) {
      comm.send(at::full({4}, 1.0), 1, 1).wait();
      comm.send(at::full({4}, 2.0), 1, 2).wait();
    } else {
      auto wb = comm.recv(b, 0, 2);
      auto wa = comm.recv(a, 0, 1);
      wb.wait();
      wa.wait();
      CHECK(at::equal(a, at::full({4}, 1.0)));
    }
  };
  test::run_ranks(2, program);
  std::vector<std::string> errors(2);
  run_ordered(
      2, [&](comm::Comm& comm) { errors[comm.rank()] = test::error_of([&] { program(comm); }); }, kShort);
  CHECK(has(errors[0],
            "this send to rank 1 (tag 1, Float, 4 elements) pairs, in NCCL's issue order, with rank 1's "
            "recv from rank 0 (tag 2, Float, 4 elements)"));
  CHECK(has(errors[1],
            "this recv from rank 0 (tag 2, Float, 4 elements) pairs, in NCCL's issue order, with rank "
            "0's send to rank 1 (tag 1, Float, 4 elements)"));
}

TEST_CASE("NCCL order: a group completes only when all of it has; a send waits for its receive to start") {
  // Rank 1 delays its receive: rank 0's send must not complete before it, whatever the size.
  std::atomic<bool> received{false};
  std::atomic<bool> send_done_early{false};
  run_ordered(2, [&](comm::Comm& comm) {
    if (comm.rank() == 0) {
      comm.send(at::ones({1}), 1).wait();
      send_done_early = !received.load();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      received = true;
      auto t = at::empty({1});
      comm.recv(t, 0).wait();
    }
  });
  CHECK_FALSE(send_done_early.load());
}

TEST_CASE("NCCL order: sub-communicators keep the order on their own queues") {
  run_ordered(4, [](comm::Comm& comm) {
    // Pairs (0, 1) and (2, 3), each exchanging both ways in a group, then a collective over each.
    auto pair = comm.split(comm.rank() / 2, comm.rank());
    const int peer = 1 - pair.rank();
    auto got = at::empty({3});
    pair.batch_p2p(
            {comm::P2POp::send(at::full({3}, double(comm.rank())), peer), comm::P2POp::recv(got, peer)})
        .wait();
    CHECK(at::equal(got, at::full({3}, double(comm.rank() ^ 1))));
    auto s = at::ones({1});
    pair.all_reduce(s).wait();
    CHECK(s.item<float>() == 2.0f);
  });
}
