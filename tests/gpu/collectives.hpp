#pragma once
// Every comm::Comm operation, each value checked against its closed form, in float32 and bfloat16
// (values small integers, exact in both). Shared by the GPU test (ranks as threads, one GPU each),
// the GPU rank program (ranks as processes under `fsdpp launch`, which may share one GPU) and, on
// CPU tensors, the NCCL-order check of the comm tests (tests/comm/test_nccl_order.cpp), which runs
// this very code under NCCL's ordering rules. Returns what went wrong, one line each; empty when
// everything matched.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "fsdpp/comm/comm.hpp"

namespace fsdpp::test {

inline std::vector<std::string> check_collectives(comm::Comm& comm, at::Device device) {
  const int r = comm.rank(), n = comm.size();
  std::vector<std::string> bad;
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) bad.push_back(fmt::format("rank {}/{}: {}", r, n, what));
  };
  const auto on = [device](at::ScalarType t) { return at::TensorOptions(device).dtype(t); };
  // Compares on the CPU in float64: exact for the small integers used here, in either dtype.
  const auto same = [](const at::Tensor& got, const at::Tensor& want) {
    return at::equal(got.cpu().to(at::kDouble), want.to(at::kDouble));
  };
  const char* backend = device.is_cuda() ? "nccl" : "gloo";
  expect(std::string(comm.backend()) == backend,
         fmt::format("backend {}, expected {}", comm.backend(), backend));
  for (const auto dt : {at::kFloat, at::kBFloat16}) {
    const std::string type = c10::toString(dt);
    auto t = at::full({5}, double(r + 1), on(dt));
    comm.all_reduce(t).wait();
    t.add_(1);  // ordered after the all-reduce on the device, without a host wait
    expect(same(t, at::full({5}, n * (n + 1) / 2.0 + 1)), type + " all_reduce sum");

    auto avg = at::full({4}, double(2 * (r + 1)), on(dt));
    comm.all_reduce(avg, {comm::ReduceOp::kAvg}).wait();
    expect(same(avg, at::full({4}, double(n + 1))), type + " all_reduce avg");

    auto mx = at::full({3}, double(r), on(dt));
    comm.all_reduce(mx, {comm::ReduceOp::kMax}).wait();
    expect(same(mx, at::full({3}, double(n - 1))), type + " all_reduce max");

    auto out = at::empty({3 * n}, on(dt));
    comm.all_gather(out, at::full({3}, double(r), on(dt))).wait();
    expect(same(out, at::arange(n, at::kDouble).repeat_interleave(3)), type + " all_gather");

    // Uneven parts: rank q contributes q + 1 elements.
    std::vector<int64_t> counts;
    for (int q = 0; q < n; ++q) counts.push_back(q + 1);
    auto uneven = at::empty({n * (n + 1) / 2}, on(dt));
    comm.all_gather(uneven, at::full({r + 1}, double(r), on(dt)), {counts}).wait();
    expect(same(uneven, at::arange(n, at::kDouble).repeat_interleave(at::arange(1, n + 1, at::kLong))),
           type + " all_gather, uneven parts");

    auto rs_in = at::arange(4 * n, on(at::kFloat)).add(double(r)).to(dt);
    auto rs_out = at::empty({4}, on(dt));
    comm.reduce_scatter(rs_out, rs_in).wait();
    expect(same(rs_out, at::arange(4 * n, at::kDouble).narrow(0, 4 * r, 4) * n + double(n * (n - 1) / 2)),
           type + " reduce_scatter");

    auto b = at::full({2}, r == 0 ? 7.0 : -1.0, on(dt));
    comm.broadcast(b).wait();
    expect(same(b, at::full({2}, 7.0)), type + " broadcast");

    auto a2a_in = at::arange(2 * n, on(at::kFloat)).add(10.0 * r).to(dt),
         a2a_out = at::empty({2 * n}, on(dt));
    comm.all_to_all(a2a_out, a2a_in).wait();
    bool a2a = true;
    for (int q = 0; q < n; ++q)
      a2a &= same(a2a_out.narrow(0, 2 * q, 2), at::arange(2, at::kDouble) + 2.0 * r + 10.0 * q);
    expect(a2a, type + " all_to_all");

    // Uneven splits: rank q sends q + 1 + p elements to rank p, each holding its own rank.
    std::vector<int64_t> in_splits, out_splits;
    for (int p = 0; p < n; ++p) in_splits.push_back(r + 1 + p), out_splits.push_back(p + 1 + r);
    int64_t in_total = 0, out_total = 0;
    for (int p = 0; p < n; ++p) in_total += in_splits[p], out_total += out_splits[p];
    auto v_in = at::full({in_total}, double(r), on(dt)), v_out = at::empty({out_total}, on(dt));
    comm.all_to_all(v_out, v_in, {in_splits, out_splits}).wait();
    expect(same(v_out, at::arange(n, at::kDouble).repeat_interleave(at::tensor(out_splits))),
           type + " all_to_all, uneven splits");

    if (n > 1) {
      // A ring: receive from the left and send to the right, in one group (Note [point-to-point
      // groups] in fsdpp/comm/comm.hpp: issued one after the other, every rank would wait in its
      // receive for a send queued behind it).
      const int left = (r + n - 1) % n, right = (r + 1) % n;
      auto got = at::empty({6}, on(dt));
      comm.batch_p2p({comm::P2POp::recv(got, left, 3),
                      comm::P2POp::send(at::full({6}, double(r), on(dt)), right, 3)})
          .wait();
      expect(same(got, at::full({6}, double(left))), type + " batch_p2p ring");
      // Both ways with one peer in one group, twice to the same peer: rank r and its partner r ^ 1.
      if (const int peer = r ^ 1; peer < n) {
        auto a = at::empty({3}, on(dt)), b = at::empty({2}, on(dt));
        comm.batch_p2p({comm::P2POp::send(at::full({3}, double(r + 10), on(dt)), peer),
                        comm::P2POp::send(at::full({2}, double(r + 20), on(dt)), peer),
                        comm::P2POp::recv(a, peer), comm::P2POp::recv(b, peer)})
            .wait();
        expect(same(a, at::full({3}, double(peer + 10))) && same(b, at::full({2}, double(peer + 20))),
               type + " batch_p2p both ways with one peer");
      }
      // Single sends and receives in an order NCCL runs: even ranks send first, odd ranks receive
      // first, each towards its partner.
      if (const int peer = r ^ 1; peer < n) {
        auto got1 = at::empty({4}, on(dt));
        const auto mine = at::full({4}, double(r + 30), on(dt));
        if (r % 2 == 0) {
          comm.send(mine, peer, 4).wait();
          comm.recv(got1, peer, 4).wait();
        } else {
          comm.recv(got1, peer, 4).wait();
          comm.send(mine, peer, 4).wait();
        }
        expect(same(got1, at::full({4}, double(peer + 30))), type + " send and recv in matching order");
      }
    }
  }
  comm.barrier().wait();
  auto sub = comm.split(0, -r);  // reversed order
  expect(sub && sub.rank() == n - 1 - r, "split: reversed rank order");
  if (sub) {
    auto s = at::ones({1}, on(at::kFloat));
    sub.all_reduce(s).wait();
    expect(s.cpu().item<float>() == float(n), "split: all_reduce");
  }
  return bad;
}

// The sequence the GPU rank program captures into a CUDA graph: all-reduce, all-to-all, a ring
// exchange. Leaves its result in `t`.
inline void round_trip(comm::Comm& comm, at::Tensor& t) {
  const int r = comm.rank(), n = comm.size();
  t.mul_(0.5).add_(r);
  comm.all_reduce(t).wait();
  auto out = at::empty_like(t);
  comm.all_to_all(out, t).wait();
  if (n > 1) {  // one group: Note [point-to-point groups] in fsdpp/comm/comm.hpp
    auto got = at::empty_like(out);
    comm.batch_p2p({comm::P2POp::recv(got, (r + n - 1) % n, 5), comm::P2POp::send(out, (r + 1) % n, 5)})
        .wait();
    out = got;
  }
  t.copy_(out);
}

}  // namespace fsdpp::test
