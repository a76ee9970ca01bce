// Comm's public entry points: argument checks with messages a person can act on, then dispatch to
// the backend. Backends may assume what is checked here.
#include "fsdpp/comm/comm.hpp"

#include "fsdpp/comm/fault.hpp"

#include "fsdpp/comm/flight_recorder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>

namespace fsdpp::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

std::string detail::OpSummary::to_string() const {
  std::string s = fmt::format("rank {}/{} {}", rank, size, op);
  if (dtype != at::ScalarType::Undefined) s += fmt::format(" {}", c10::toString(dtype));
  if (reduce) s += fmt::format(" {}", reduce);
  if (root >= 0) s += fmt::format(" root={}", root);
  if (in >= 0) s += fmt::format(" in={}", in);
  if (out >= 0) s += fmt::format(" out={}", out);
  if (n >= 0) s += fmt::format(" n={}", n);
  return s;
}

namespace {

bool supported(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
    case at::kByte:
      return true;
    default:
      return false;
  }
}

}  // namespace

class Comm::Checker {
 public:
  Checker(const Comm& c, const char* op) : rank_(c.rank()), size_(c.size_), op_(op), cuda_(c.takes_cuda_) {}

  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) const {
    throw CommError(
        fmt::format("rank {}/{} {}: {}", rank_, size_, op_, fmt::format(f, std::forward<Args>(args)...)));
  }

  void tensor(const at::Tensor& t, const char* name) const {
    if (!t.defined()) fail("{} is an undefined tensor", name);
    if (!supported(t.scalar_type()))
      fail("{} has dtype {}, supported are float32, float64, bfloat16, float16, int32, int64, uint8", name,
           c10::toString(t.scalar_type()));
    if (!t.is_contiguous()) fail("{} must be contiguous (call .contiguous() first)", name);
    if (cuda_ ? !t.is_cuda() : !t.is_cpu())
      fail("{} is on {}; this communicator's backend ({}) takes {} tensors", name, t.device().str(),
           cuda_ ? "nccl" : "gloo", cuda_ ? "CUDA" : "CPU");
  }

  void same_dtype(const at::Tensor& a, const at::Tensor& b) const {
    if (a.scalar_type() != b.scalar_type())
      fail("out has dtype {} but in has dtype {}", c10::toString(a.scalar_type()),
           c10::toString(b.scalar_type()));
  }

  void reduction(ReduceOp op, const at::Tensor& t) const {
    if (op == ReduceOp::kAvg && !at::isFloatingType(t.scalar_type()))
      fail("average of integer dtype {} is not defined; use sum and divide", c10::toString(t.scalar_type()));
  }

  void peer(int p, const char* what) const {
    if (p < 0 || p >= size_) fail("{} rank {} is outside [0, {})", what, p, size_);
  }

  void splits(const std::vector<int64_t>& v, int64_t numel, const char* name) const {
    if (static_cast<int>(v.size()) != size_)
      fail("{} has {} entries, expected one per rank ({})", name, v.size(), size_);
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i] < 0) fail("{}[{}] is negative ({})", name, i, v[i]);
    const int64_t total = std::accumulate(v.begin(), v.end(), int64_t{0});
    if (total != numel) fail("{} sums to {} but the tensor has {} elements", name, total, numel);
  }

 private:
  int rank_, size_;
  const char* op_;
  bool cuda_;  // the backend takes CUDA tensors
};

Comm::Comm(std::shared_ptr<detail::CommImpl> impl, const std::string& name) : impl_(std::move(impl)) {
  if (!impl_) return;
  rank_ = impl_->rank();
  size_ = impl_->size();
  takes_cuda_ = std::strcmp(impl_->backend(), "nccl") == 0;
  recorder_ = detail::make_recorder(name, rank_, size_);
  const char* env = std::getenv("FSDPP_CHECK_COLLECTIVES");
  check_ = std::make_shared<bool>(env && std::string(env) == "1");
}

void Comm::set_consistency_check(bool on) {
  impl();
  *check_ = on;
}

namespace {

const char* kOpNames[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier"};

std::string describe_fingerprint(const int64_t* f) {
  std::string s = kOpNames[f[0]];
  if (f[0] != 5)
    s += fmt::format(" {} in={} out={}", c10::toString(static_cast<at::ScalarType>(f[1])), f[2], f[3]);
  if (f[0] == 3) s += fmt::format(" root={}", f[4]);
  return s;
}

}  // namespace

// Runs on the caller's thread, before the collective is queued: the check is itself a collective
// on the same communicator, so ranks that lost step meet in it and see each other's intent.
void Comm::check_consistency(int op, const at::Tensor* in, const at::Tensor* out, int64_t extra) {
  if (!check_ || !*check_ || size() == 1) return;
  const at::Tensor* t = in ? in : out;
  // A barrier over NCCL has no tensor to tell the device by; it is left unchecked.
  if (!t && takes_cuda_) return;
  auto mine = at::tensor({int64_t{op}, t ? static_cast<int64_t>(t->scalar_type()) : -1, in ? in->numel() : 0,
                          out ? out->numel() : 0, extra},
                         at::kLong);
  // On the operation's device (the backend's), read back on the host.
  const auto device = t ? t->device() : at::Device(at::kCPU);
  auto all = at::empty({size() * 5}, at::TensorOptions(device).dtype(at::kLong));
  impl().all_gather(all, mine.to(device), {}).wait();
  all = all.cpu();
  const auto* f = all.data_ptr<int64_t>();
  const auto* m = mine.data_ptr<int64_t>();
  for (int r = 0; r < size(); ++r)
    if (!std::equal(m, m + 5, f + 5 * r))
      throw CommError(
          fmt::format("rank {}/{} consistency check failed: this rank issues {}, rank {} issues {}", rank(),
                      size(), describe_fingerprint(m), r, describe_fingerprint(f + 5 * r)));
}

template <typename Issue>
Work Comm::recorded(const char* op, const at::Tensor* in, const at::Tensor* out, int peer, Issue&& issue) {
  if (!recorder_ || !recorder_->enabled()) return issue();  // no clock read for a recorder that is off
  const auto issued = std::chrono::system_clock::now();
  Work work = issue();
  recorder_->record(op, in, out, peer, work, issued);
  return work;
}

void Comm::throw_empty() {
  throw CommError("use of an empty Comm (this rank is not a member of that group)");
}

detail::CommImpl& Comm::impl() const {
  if (!impl_) throw_empty();
  return *impl_;
}

const char* Comm::backend() const { return impl().backend(); }

Work Comm::all_gather(const at::Tensor& out, const at::Tensor& in, AllGatherOptions opts) {
  if (detail::skip_this_all_gather()) return Work();  // FSDPP_FAULT (fsdpp/comm/fault.hpp)
  Checker c(*this, "all_gather");
  c.tensor(out, "out");
  c.tensor(in, "in");
  c.same_dtype(out, in);
  if (opts.counts.empty()) {
    if (out.numel() != size() * in.numel())
      c.fail("out has {} elements, expected {} ranks x {} = {}", out.numel(), size(), in.numel(),
             size() * in.numel());
  } else {
    c.splits(opts.counts, out.numel(), "counts");
    if (opts.counts[rank()] != in.numel())
      c.fail("counts[{}] is {} but in has {} elements", rank(), opts.counts[rank()], in.numel());
  }
  check_consistency(0, &in, &out, 0);
  return recorded("all_gather", &in, &out, -1, [&] { return impl().all_gather(out, in, opts); });
}

Work Comm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceScatterOptions opts) {
  Checker c(*this, "reduce_scatter");
  c.tensor(out, "out");
  c.tensor(in, "in");
  c.same_dtype(out, in);
  c.reduction(opts.op, out);
  if (in.numel() != size() * out.numel())
    c.fail("in has {} elements, expected {} ranks x {} = {}", in.numel(), size(), out.numel(),
           size() * out.numel());
  check_consistency(1, &in, &out, static_cast<int64_t>(opts.op));
  return recorded("reduce_scatter", &in, &out, -1, [&] { return impl().reduce_scatter(out, in, opts); });
}

Work Comm::all_reduce(const at::Tensor& t, AllReduceOptions opts) {
  Checker c(*this, "all_reduce");
  c.tensor(t, "tensor");
  c.reduction(opts.op, t);
  check_consistency(2, &t, &t, static_cast<int64_t>(opts.op));
  return recorded("all_reduce", &t, &t, -1, [&] { return impl().all_reduce(t, opts); });
}

Work Comm::broadcast(const at::Tensor& t, BroadcastOptions opts) {
  Checker c(*this, "broadcast");
  c.tensor(t, "tensor");
  c.peer(opts.root, "root");
  check_consistency(3, &t, &t, opts.root);
  return recorded("broadcast", &t, &t, -1, [&] { return impl().broadcast(t, opts); });
}

Work Comm::all_to_all(const at::Tensor& out, const at::Tensor& in, AllToAllOptions opts) {
  Checker c(*this, "all_to_all");
  c.tensor(out, "out");
  c.tensor(in, "in");
  c.same_dtype(out, in);
  if (opts.in_splits.empty() != opts.out_splits.empty())
    c.fail("give both in_splits and out_splits, or neither for equal splits");
  if (opts.in_splits.empty()) {
    if (in.numel() % size() != 0)
      c.fail("in has {} elements, not divisible into {} equal splits", in.numel(), size());
    if (out.numel() != in.numel())
      c.fail("out has {} elements but in has {}; equal splits need the same", out.numel(), in.numel());
  } else {
    c.splits(opts.in_splits, in.numel(), "in_splits");
    c.splits(opts.out_splits, out.numel(), "out_splits");
  }
  check_consistency(4, &in, &out, 0);
  return recorded("all_to_all", &in, &out, -1, [&] { return impl().all_to_all(out, in, opts); });
}

Work Comm::send(const at::Tensor& t, int dst, uint32_t tag) { return batch_p2p({P2POp::send(t, dst, tag)}); }

Work Comm::recv(const at::Tensor& t, int src, uint32_t tag) { return batch_p2p({P2POp::recv(t, src, tag)}); }

Work Comm::batch_p2p(const std::vector<P2POp>& ops) {
  if (ops.empty()) return Work();
  for (const auto& op : ops) {
    const bool send = op.kind == P2POp::Kind::kSend;
    Checker c(*this, send ? "send" : "recv");
    c.tensor(op.tensor, "tensor");
    c.peer(op.peer, send ? "destination" : "source");
    if (op.peer == rank())
      c.fail("{} self (rank {}) is not supported", send ? "send to" : "receive from", op.peer);
  }
  if (!recorder_ || !recorder_->enabled()) return impl().p2p(ops);
  const auto issued = std::chrono::system_clock::now();
  Work work = impl().p2p(ops);
  for (const auto& op : ops) {
    const bool send = op.kind == P2POp::Kind::kSend;
    recorder_->record(send ? "send" : "recv", send ? &op.tensor : nullptr, send ? nullptr : &op.tensor,
                      op.peer, work, issued);
  }
  return work;
}

Work Comm::barrier() {
  check_consistency(5, nullptr, nullptr, 0);
  return recorded("barrier", nullptr, nullptr, -1, [&] { return impl().barrier(); });
}

Comm Comm::split(int color, int key) const {
  // Every rank splits in the same order, so the counter names the same child everywhere.
  const std::string child = recorder_ ? recorder_->child_name(color) : "split";
  return Comm(impl().split(color, key), child);
}

}  // namespace fsdpp::comm
