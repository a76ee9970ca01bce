// Point-to-point, stream ordering with many operations in flight, split, and DeviceMesh.
#include "fsdpp/comm/mesh.hpp"
#include "comm/ranks.hpp"

using namespace fsdpp;

TEST_CASE("send/recv around a ring, in every dtype, with per-tag ordering") {
  for (int n = 2; n <= 4; ++n)
    test::run_ranks(n, [n](comm::Comm& comm) {
      const int r = comm.rank(), right = (r + 1) % n, left = (r + n - 1) % n;
      for (auto dtype : test::all_dtypes()) {
        // Receives are posted before sends on every rank: posting never blocks, so no deadlock.
        auto a = at::empty({5}, dtype), b = at::empty({5}, dtype), c = at::empty({0}, dtype);
        auto ra = comm.recv(a, left, 7);
        auto rb = comm.recv(b, left, 7);
        auto rc = comm.recv(c, left, 9);
        auto sa = comm.send(at::full({5}, r + 1, dtype), right, 7);
        auto sb = comm.send(at::full({5}, r + 2, dtype), right, 7);
        auto sc = comm.send(at::empty({0}, dtype), right, 9);
        comm::wait_all({ra, rb, rc, sa, sb, sc});
        // Two messages with the same tag arrive in the order they were sent.
        CHECK(at::equal(a, at::full({5}, left + 1, dtype)));
        CHECK(at::equal(b, at::full({5}, left + 2, dtype)));
      }
    });
}

TEST_CASE("operations run in issue order, and many can be in flight") {
  test::run_ranks(3, [](comm::Comm& comm) {
    // Two all_reduces of one tensor, issued without waiting: the second must see the first's
    // result, giving 3 * 3 * x.
    auto t = at::full({1000}, comm.rank() + 1.0);
    auto w1 = comm.all_reduce(t);
    auto w2 = comm.all_reduce(t);
    w2.wait();
    CHECK(w1.is_completed());  // completed in order
    CHECK(at::equal(t, at::full({1000}, 18.0)));

    // 64 operations of mixed kinds in flight before the first wait.
    std::vector<comm::Work> works;
    std::vector<at::Tensor> sums, gathers;
    for (int i = 0; i < 64; ++i) {
      if (i % 2 == 0) {
        sums.push_back(at::full({257}, static_cast<double>(i + comm.rank())));
        works.push_back(comm.all_reduce(sums.back()));
      } else {
        gathers.push_back(at::empty({3 * 4}, at::kLong));
        works.push_back(comm.all_gather(gathers.back(), at::full({4}, i * 10 + comm.rank(), at::kLong)));
      }
    }
    comm::wait_all(works);
    for (size_t k = 0; k < sums.size(); ++k)  // sum over ranks of (i + rank), i = 2k
      CHECK(at::equal(sums[k], at::full({257}, 3.0 * 2 * k + 3)));
    for (size_t k = 0; k < gathers.size(); ++k) {
      const int64_t i = 2 * k + 1;
      auto want = at::cat({at::full({4}, i * 10, at::kLong), at::full({4}, i * 10 + 1, at::kLong),
                           at::full({4}, i * 10 + 2, at::kLong)});
      CHECK(at::equal(gathers[k], want));
    }
  });
}

TEST_CASE("an operation that a peer never joins fails its Work with the rank and operation") {
  test::run_ranks(
      2,
      [](comm::Comm& comm) {
        if (comm.rank() == 1) return;  // rank 1 never issues the all_reduce
        auto t = at::ones({16});
        auto w = comm.all_reduce(t);
        std::string msg;
        try {
          w.wait();
        } catch (const comm::CommError& e) {
          msg = e.what();
        }
        CHECK(msg.find("rank 0/2 all_reduce") != std::string::npos);
        CHECK(msg.find("failed") != std::string::npos);
        // The communicator is now unusable and says so at once instead of hanging.
        msg.clear();
        try {
          comm.barrier().wait();
        } catch (const comm::CommError& e) {
          msg = e.what();
        }
        CHECK(msg.find("barrier") != std::string::npos);
      },
      std::chrono::seconds(2));
}

TEST_CASE("split: groups by color, ordered by key; negative color is left out") {
  test::run_ranks(4, [](comm::Comm& comm) {
    const int r = comm.rank();
    // Rank 3 opts out; ranks 0 and 2 form one group, rank 1 alone the other. Key -r reverses
    // the order inside a group.
    const int color = r == 3 ? -1 : r % 2;
    auto sub = comm.split(color, -r);
    if (r == 3) {
      CHECK_FALSE(sub);
      // Using it is an error that says why, for a query and an operation alike.
      const char* why = "use of an empty Comm (this rank is not a member of that group)";
      CHECK_THROWS_WITH_AS(sub.rank(), why, comm::CommError);
      CHECK_THROWS_WITH_AS(sub.size(), why, comm::CommError);
      CHECK_THROWS_WITH_AS(sub.all_reduce(at::ones({2})), why, comm::CommError);
      CHECK_THROWS_WITH_AS(sub.barrier(), why, comm::CommError);
      return;
    }
    REQUIRE(sub);
    CHECK(sub.size() == (r % 2 == 0 ? 2 : 1));
    CHECK(sub.rank() == (r == 0 ? 1 : 0));
    auto t = at::full({4}, r + 1.0);
    sub.all_reduce(t).wait();
    CHECK(at::equal(t, at::full({4}, r % 2 == 0 ? 4.0 : 2.0)));  // 1 + 3, or 2
    // Splits of splits work too.
    auto subsub = sub.split(0, 0);
    auto u = at::ones({2});
    subsub.all_reduce(u).wait();
    CHECK(at::equal(u, at::full({2}, static_cast<double>(sub.size()))));
  });
}

TEST_CASE("DeviceMesh: coordinates and one communicator per dimension") {
  test::run_ranks(4, [](comm::Comm& comm) {
    comm::DeviceMesh mesh(comm, {{"pp", 2}, {"dp", 2}});
    const int r = comm.rank();
    CHECK(mesh.coord("pp") == r / 2);
    CHECK(mesh.coord("dp") == r % 2);
    CHECK(mesh.rank_at(mesh.coords()) == r);
    CHECK(mesh.comm("dp").size() == 2);
    CHECK(mesh.comm("dp").rank() == r % 2);
    CHECK(mesh.comm("pp").rank() == r / 2);
    // dp groups are {0,1} and {2,3}; pp groups are {0,2} and {1,3}.
    auto t = at::full({1}, static_cast<double>(r));
    mesh.comm("dp").all_reduce(t).wait();
    CHECK(t.item<double>() == (r < 2 ? 1.0 : 5.0));
    auto u = at::full({1}, static_cast<double>(r));
    mesh.comm("pp").all_reduce(u).wait();
    CHECK(u.item<double>() == (r % 2 == 0 ? 2.0 : 4.0));

    std::string msg;
    try {
      comm::DeviceMesh bad(comm, {{"pp", 3}, {"dp", 2}});
    } catch (const comm::CommError& e) {
      msg = e.what();
    }
    CHECK(msg.find("pp=3 x dp=2 gives 6 ranks, but the world has 4") != std::string::npos);
    msg.clear();
    try {
      mesh.coord("tp");
    } catch (const comm::CommError& e) {
      msg = e.what();
    }
    CHECK(msg.find("no dimension 'tp' (have pp, dp)") != std::string::npos);
  });
}
