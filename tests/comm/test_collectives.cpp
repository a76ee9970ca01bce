// Every collective at world sizes 1-4, in every supported dtype, with zero-length and uneven
// sizes, against closed-form expected values.
#include "comm/ranks.hpp"

using namespace fsdpp;
using comm::ReduceOp;

namespace {

// A pattern value small enough to be exact in every dtype, uint8 included.
at::Tensor pattern(int64_t n, int64_t period) { return at::arange(n, at::kDouble).remainder(period); }

void check_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  INFO(what);
  REQUIRE(std::string(c10::toString(got.scalar_type())) == c10::toString(want.scalar_type()));
  CHECK(got.sizes().vec() == want.sizes().vec());
  // Exact equality: every rank must hold the same bits.
  CHECK(at::equal(got, want));
}

}  // namespace

TEST_CASE("all_reduce: sum, avg, max, min in every dtype, sizes 0..1000, world 1..4") {
  for (int n = 1; n <= 4; ++n)
    test::run_ranks(n, [n](comm::Comm& comm) {
      const int r = comm.rank();
      for (auto dtype : test::all_dtypes())
        for (int64_t len : {0, 1, 7, 1000})
          for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
            if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
            auto p = pattern(len, 5);
            auto t = (p + (r + 1)).to(dtype);
            comm.all_reduce(t, {op}).wait();
            at::Tensor want;
            switch (op) {
              case ReduceOp::kSum:
                want = p * n + n * (n + 1) / 2.0;
                break;
              case ReduceOp::kAvg:
                want = p + (n + 1) / 2.0;
                break;
              case ReduceOp::kMax:
                want = p + n;
                break;
              case ReduceOp::kMin:
                want = p + 1;
                break;
            }
            check_equal(t, want.to(dtype),
                        "world " + std::to_string(n) + " rank " + std::to_string(r) + " " +
                            c10::toString(dtype) + " len " + std::to_string(len) + " op " +
                            comm::to_string(op));
          }
    });
}

TEST_CASE("16-bit reductions accumulate in float32: 256 + 1 + 1 stays 258 in bfloat16") {
  // In bfloat16, 256 + 1 rounds back to 256, so a sum that accumulated in bfloat16 would depend on
  // the order of the additions; accumulated in float32 every element is exactly 258.
  test::run_ranks(3, [](comm::Comm& comm) {
    for (auto dtype : {at::kBFloat16, at::kHalf}) {
      const double mine = comm.rank() == 0 ? 256 : 1;
      auto t = at::full({9}, mine, dtype);
      comm.all_reduce(t).wait();
      check_equal(t, at::full({9}, 258.0, dtype), "all_reduce");
      auto in = at::full({9}, mine, dtype), out = at::empty({3}, dtype);
      comm.reduce_scatter(out, in).wait();
      check_equal(out, at::full({3}, 258.0, dtype), "reduce_scatter");
    }
  });
}

TEST_CASE("16-bit all_reduce and reduce_scatter: the exact sum rounded once, the same bits on every rank") {
  // Rank s's values: magnitudes in [0.01, 4], so that the sum of four of them in 16 bits is exact
  // in float32. Partial sums rounded to 16 bits at each hop (from world 3 on) would differ.
  constexpr int64_t kLen = 1003;  // not a multiple of the world size: all_reduce pads
  auto values = [](int s) {
    const auto x = at::sin(at::arange(kLen, at::kDouble) * 0.7 + s * 1.3) * 4;
    return x.sign() * x.abs().clamp_min(0.01);
  };
  for (int n = 2; n <= 4; ++n)
    test::run_ranks(n, [&](comm::Comm& comm) {
      for (auto dtype : {at::kBFloat16, at::kHalf}) {
        auto exact = at::zeros({kLen}, at::kDouble);
        for (int s = 0; s < n; ++s) exact += values(s).to(dtype).to(at::kDouble);
        auto t = values(comm.rank()).to(dtype);
        comm.all_reduce(t).wait();
        check_equal(t, exact.to(dtype), std::string("all_reduce ") + c10::toString(dtype));
        const int64_t c = kLen / n;
        auto in = values(comm.rank()).narrow(0, 0, c * n).to(dtype), out = at::empty({c}, dtype);
        comm.reduce_scatter(out, in).wait();
        check_equal(out, exact.narrow(0, comm.rank() * c, c).to(dtype),
                    std::string("reduce_scatter ") + c10::toString(dtype));
      }
    });
}

TEST_CASE("all_gather: rank-major output, in-place input, uneven and zero counts") {
  for (int n = 1; n <= 4; ++n)
    test::run_ranks(n, [n](comm::Comm& comm) {
      const int r = comm.rank();
      for (auto dtype : test::all_dtypes()) {
        for (int64_t k : {0, 1, 5, 1000}) {
          auto contribution = [&](int rank) { return pattern(k, 10) + 10 * rank; };
          auto want = at::cat([&] {
                        std::vector<at::Tensor> v;
                        for (int s = 0; s < n; ++s) v.push_back(contribution(s));
                        return v;
                      }())
                          .to(dtype);
          auto out = at::empty({n * k}, dtype);
          comm.all_gather(out, contribution(r).to(dtype)).wait();
          check_equal(out, want, "all_gather k=" + std::to_string(k));

          // The input is a view of this rank's own slot of the output.
          auto out2 = at::zeros({n * k}, dtype);
          out2.narrow(0, r * k, k).copy_(contribution(r));
          comm.all_gather(out2, out2.narrow(0, r * k, k)).wait();
          check_equal(out2, want, "in-place all_gather k=" + std::to_string(k));
        }
        // Uneven: rank s contributes (s + 1) % 3 elements, so some contribute none.
        std::vector<int64_t> counts;
        std::vector<at::Tensor> parts;
        for (int s = 0; s < n; ++s) {
          counts.push_back((s + 1) % 3);
          parts.push_back(pattern(counts.back(), 10) + 10 * s);
        }
        auto want = at::cat(parts).to(dtype);
        auto out = at::empty({want.numel()}, dtype);
        comm.all_gather(out, parts[r].to(dtype), {counts}).wait();
        check_equal(out, want, "uneven all_gather");
      }
    });
}

TEST_CASE("reduce_scatter: sum, avg, max and min, chunk sizes 0..1000, world 1..4") {
  for (int n = 1; n <= 4; ++n)
    test::run_ranks(n, [n](comm::Comm& comm) {
      const int r = comm.rank();
      for (auto dtype : test::all_dtypes())
        for (int64_t c : {0, 1, 6, 1000})
          for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
            if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
            // Rank s puts (s + 1) * (j + 1) + i % 3 into chunk j.
            std::vector<at::Tensor> chunks;
            for (int j = 0; j < n; ++j) chunks.push_back(pattern(c, 3) + (r + 1) * (j + 1));
            auto in = at::cat(chunks).to(dtype);
            auto out = at::empty({c}, dtype);
            comm.reduce_scatter(out, in, {op}).wait();
            const double ranks_sum = n * (n + 1) / 2.0;
            at::Tensor want;
            switch (op) {
              case ReduceOp::kSum:
                want = pattern(c, 3) * n + (r + 1) * ranks_sum;
                break;
              case ReduceOp::kAvg:
                want = pattern(c, 3) + (r + 1) * ranks_sum / n;
                break;
              case ReduceOp::kMax:
                want = pattern(c, 3) + (r + 1) * n;
                break;  // rank n - 1's
              case ReduceOp::kMin:
                want = pattern(c, 3) + (r + 1);
                break;  // rank 0's
            }
            check_equal(out, want.to(dtype),
                        std::string("reduce_scatter ") + c10::toString(dtype) + " c=" + std::to_string(c) +
                            " " + comm::to_string(op));
          }
    });
}

TEST_CASE("broadcast from the first and the last rank") {
  for (int n = 1; n <= 4; ++n)
    test::run_ranks(n, [n](comm::Comm& comm) {
      for (auto dtype : test::all_dtypes())
        for (int root : {0, n - 1})
          for (int64_t len : {0, 3, 1000}) {
            auto want = pattern(len, 100).to(dtype);
            auto t = comm.rank() == root ? want.clone() : at::zeros({len}, dtype);
            comm.broadcast(t, {root}).wait();
            check_equal(t, want, "broadcast root " + std::to_string(root));
          }
    });
}

TEST_CASE("all_to_all: equal and unequal splits, zero-length pieces") {
  for (int n = 1; n <= 4; ++n)
    test::run_ranks(n, [n](comm::Comm& comm) {
      const int r = comm.rank();
      // What rank `from` sends to rank `to`: len elements of from * 40 + to * 8 + i % 8.
      auto piece = [](int from, int to, int64_t len) { return pattern(len, 8) + from * 40 + to * 8; };
      for (auto dtype : test::all_dtypes()) {
        for (int64_t k : {0, 2, 300}) {
          std::vector<at::Tensor> send, expect;
          for (int j = 0; j < n; ++j) {
            send.push_back(piece(r, j, k));
            expect.push_back(piece(j, r, k));
          }
          auto out = at::empty({n * k}, dtype);
          comm.all_to_all(out, at::cat(send).to(dtype)).wait();
          check_equal(out, at::cat(expect).to(dtype), "equal all_to_all k=" + std::to_string(k));
        }
        // Rank `from` sends (from + to) % 3 elements to rank `to`.
        std::vector<int64_t> in_splits, out_splits;
        std::vector<at::Tensor> send, expect;
        for (int j = 0; j < n; ++j) {
          in_splits.push_back((r + j) % 3);
          out_splits.push_back((j + r) % 3);
          send.push_back(piece(r, j, in_splits.back()));
          expect.push_back(piece(j, r, out_splits.back()));
        }
        auto want = at::cat(expect).to(dtype);
        auto out = at::empty({want.numel()}, dtype);
        comm.all_to_all(out, at::cat(send).to(dtype), {in_splits, out_splits}).wait();
        check_equal(out, want, "unequal all_to_all");
      }
    });
}

TEST_CASE("bad arguments are rejected with the rank, the operation and the sizes") {
  test::run_ranks(2, [](comm::Comm& comm) {
    auto msg = [](auto&& f) {
      try {
        f();
      } catch (const comm::CommError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    const std::string prefix = "rank " + std::to_string(comm.rank()) + "/2 ";
    auto m = msg([&] { comm.all_gather(at::empty({7}), at::empty({4})); });
    CHECK(m.find(prefix + "all_gather") != std::string::npos);
    CHECK(m.find("expected 2 ranks x 4 = 8") != std::string::npos);
    m = msg([&] { comm.all_reduce(at::empty({4}, at::kBool)); });
    CHECK(m.find("dtype Bool") != std::string::npos);
    m = msg([&] { comm.all_reduce(at::empty({4}, at::kInt), {ReduceOp::kAvg}); });
    CHECK(m.find("average of integer") != std::string::npos);
    m = msg([&] { comm.reduce_scatter(at::empty({2}), at::empty({5})); });
    CHECK(m.find("in has 5 elements, expected 2 ranks x 2 = 4") != std::string::npos);
    m = msg([&] { comm.all_reduce(at::empty({4, 4}).t()); });
    CHECK(m.find("contiguous") != std::string::npos);
    m = msg([&] { comm.all_reduce(at::empty({4}, at::TensorOptions(at::kMeta))); });
    CHECK(m.find("is on meta; this communicator's backend (gloo) takes CPU tensors") != std::string::npos);
    m = msg([&] { comm.send(at::empty({1}), 5); });
    CHECK(m.find("destination rank 5 is outside [0, 2)") != std::string::npos);
    m = msg([&] { comm.all_gather(at::empty({3}, at::kDouble), at::empty({1}, at::kFloat), {{1, 2}}); });
    CHECK(m.find("dtype") != std::string::npos);
    // Nothing above reached the wire: the communicator still works.
    auto t = at::ones({3});
    comm.all_reduce(t).wait();
    CHECK(at::equal(t, at::full({3}, 2.0f)));
  });
}
