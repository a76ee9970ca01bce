// The Gloo backend: CPU tensors over Debian's libgloo (TCP transport). Built as a plugin of its own,
// libfsdpp_gloo.so, which libfsdpp opens on first use (Note [Gloo in its own lookup scope]).
//
// Note [one worker thread per communicator]
// Each communicator owns a worker thread that runs its collectives one after another, in issue
// order. That gives stream semantics (issue many, wait later) and lets compute continue while
// communication runs, and since a gloo context is never used by two collectives at once, each
// collective can use a fresh tag without any cross-thread coordination: the count of collectives
// before it, which every rank agrees on (point-to-point operations count for nothing: ranks issue
// different numbers of them). Point-to-point operations are posted by the worker (so they keep
// issue order) but completed by a second thread, so that a posted receive never blocks the
// collectives behind it.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "gloo_plugin.hpp"

namespace fsdpp::comm::detail {

namespace {

std::shared_ptr<CommImpl> make_comm(std::shared_ptr<Store> store, int rank, int size,
                                    const BackendConfig& config);

constexpr uint8_t kReduceScatterSlotPrefix = 0x41;  // gloo's own prefixes are 0x01-0x0f
constexpr uint8_t kPointToPointSlotPrefix = 0x42;
constexpr uint8_t kAllGatherSlotPrefix = 0x43;

class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  explicit GlooStoreAdapter(comm::Store& store) : store_(store) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(key);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, kDefaultTimeout); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_.wait(keys, timeout);
  }

 private:
  comm::Store& store_;
};

// One TCP device (one listening socket and event loop) per bind address per process.
std::shared_ptr<gloo::transport::Device> device_for(const std::string& address) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<gloo::transport::Device>> devices;
  std::lock_guard<std::mutex> lock(mu);
  if (auto d = devices[address].lock()) return d;
  gloo::transport::tcp::attr attr;
  attr.hostname = address;
  auto d = gloo::transport::tcp::CreateDevice(attr);
  devices[address] = d;
  return d;
}

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// z[i] = op(x[i], y[i]) computed in Acc, x and y read as their own types (a 16-bit input read
// into float32), stored as Z. `divisor` > 0 divides each sum by it before the store: an average's
// last hop, which writes the result in place of a separate division and copy.
template <typename Acc, typename Z, typename X, typename Y>
void combine(ReduceOp op, Z* z, const X* x, const Y* y, size_t n, int divisor = 0) {
  auto sum = [&](size_t i) { return static_cast<Acc>(static_cast<Acc>(x[i]) + static_cast<Acc>(y[i])); };
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      if (divisor > 0) {
        const Acc d = static_cast<Acc>(divisor);
        for (size_t i = 0; i < n; ++i) z[i] = static_cast<Z>(static_cast<Acc>(sum(i) / d));
      } else {
        for (size_t i = 0; i < n; ++i) z[i] = static_cast<Z>(sum(i));
      }
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i)
        z[i] = static_cast<Z>(std::max(static_cast<Acc>(x[i]), static_cast<Acc>(y[i])));
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i)
        z[i] = static_cast<Z>(std::min(static_cast<Acc>(x[i]), static_cast<Acc>(y[i])));
      return;
  }
}

// Calls f.template operator()<T>() with T the C++ type of the dtype.
template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      return f.template operator()<float>();
    case at::kDouble:
      return f.template operator()<double>();
    case at::kBFloat16:
      return f.template operator()<c10::BFloat16>();
    case at::kHalf:
      return f.template operator()<c10::Half>();
    case at::kInt:
      return f.template operator()<int32_t>();
    case at::kLong:
      return f.template operator()<int64_t>();
    case at::kByte:
      return f.template operator()<uint8_t>();
    default:
      throw CommError(fmt::format("internal: no reduction for {}", c10::toString(t)));
  }
}

// A posted group of sends and receives, completed together by a waiter thread.
struct P2pGroup {
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> buffers;
  std::vector<bool> is_send;
  std::shared_ptr<WorkState> state;
};

class GlooComm : public CommImpl {
 public:
  GlooComm(std::shared_ptr<Store> store, int rank, int size, const BackendConfig& config)
      : store_(std::move(store)), rank_(rank), size_(size), config_(config) {
    context_ = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context_->setTimeout(config.timeout);
    try {
      auto device = device_for(config.bind_address);
      GlooStoreAdapter adapter(*store_);
      context_->connectFullMesh(adapter, device);
      // A rank may finish its side of the mesh before its peers finish theirs; if it went on and
      // closed the communicator, they would fail. Returning only once all are connected makes
      // "connected" mean the same thing on every rank.
      if (size > 1) {
        gloo::BarrierOptions barrier(context_);
        barrier.setTimeout(config.timeout);
        gloo::barrier(barrier);
      }
    } catch (const std::exception& e) {
      throw CommError(
          fmt::format("rank {}/{}: connecting the Gloo transport (listening on {}) "
                      "failed: {}",
                      rank, size, config.bind_address, e.what()));
    }
    worker_ = std::thread([this] { run_worker(); });
  }

  ~GlooComm() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
    std::lock_guard<std::mutex> lock(waiters_mu_);
    for (auto& w : waiters_) w.thread.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "gloo"; }

  Work all_gather(const at::Tensor& out, const at::Tensor& in, const AllGatherOptions& opts) override {
    auto what = summary("all_gather", in);
    what.in = in.numel(), what.out = out.numel();
    if (size_ == 1) return alone(what, [&] { copy_alone(out, in); });
    return enqueue(what, {out, in}, [this, out, in, counts = opts.counts](uint32_t tag) {
      const size_t esize = out.element_size();
      if (counts.empty()) {
        if (in.numel() == 0) return;
        auto* slot = static_cast<uint8_t*>(out.data_ptr()) + rank_ * in.numel() * esize;
        // The input may already sit in this rank's slot of the output.
        if (in.data_ptr() != slot) std::memcpy(slot, in.const_data_ptr(), in.nbytes());
        ring_all_gather(out, in.nbytes(), tag);
      } else {
        if (out.numel() == 0) return;
        std::vector<size_t> bytes(counts.size());
        for (size_t i = 0; i < counts.size(); ++i) bytes[i] = counts[i] * esize;
        gloo::AllgathervOptions o(context_);
        o.setInput(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
        o.setOutput(static_cast<uint8_t*>(out.data_ptr()), bytes);
        o.setTag(tag);
        o.setTimeout(config_.timeout);
        gloo::allgatherv(o);
      }
    });
  }

  Work reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                      const ReduceScatterOptions& opts) override {
    auto what = summary("reduce_scatter", in);
    what.reduce = to_string(opts.op), what.in = in.numel(), what.out = out.numel();
    // The sum or average over one rank is the input.
    if (size_ == 1) return alone(what, [&] { copy_alone(out, in); });
    return enqueue(what, {out, in},
                   [this, out, in, op = opts.op](uint32_t tag) { ring_reduce_scatter(out, in, op, tag); });
  }

  Work all_reduce(const at::Tensor& t, const AllReduceOptions& opts) override {
    auto what = summary("all_reduce", t);
    what.reduce = to_string(opts.op), what.n = t.numel();
    return enqueue(what, {t}, [this, t, op = opts.op](uint32_t tag) {
      if (t.numel() == 0 || size_ == 1) return;
      ring_all_reduce(t, op, tag);
    });
  }

  // The ring reduce-scatter, then the ring all-gather of the reduced chunks (16-bit floats: partial
  // sums in float32, each chunk rounded once by the rank that reduced it, and gathered in its own
  // dtype). Every rank receives the same bits.
  void ring_all_reduce(const at::Tensor& t, ReduceOp op, uint32_t tag) {
    const int64_t numel = t.numel(), chunk = (numel + size_ - 1) / size_;
    const bool padded = chunk * size_ != numel;
    at::Tensor flat = t.view(-1);
    if (padded) {  // zero-padded to whole chunks; the padding is dropped after
      flat = at::zeros({chunk * size_}, t.options());
      flat.narrow(0, 0, numel).copy_(t.view(-1));
    }
    // The reduced chunk lands in this rank's slot: the ring writes its output after its last read.
    ring_reduce_scatter(flat.narrow(0, rank_ * chunk, chunk), flat, op, tag);
    ring_all_gather(flat, chunk * flat.element_size(), tag);
    if (padded) t.view(-1).copy_(flat.narrow(0, 0, numel));
  }

  Work broadcast(const at::Tensor& t, const BroadcastOptions& opts) override {
    auto what = summary("broadcast", t);
    what.root = opts.root, what.n = t.numel();
    return enqueue(what, {t}, [this, t, root = opts.root](uint32_t tag) {
      if (t.numel() == 0 || size_ == 1) return;
      gloo::BroadcastOptions o(context_);
      o.setOutput(static_cast<uint8_t*>(t.data_ptr()), t.nbytes());
      o.setRoot(root);
      o.setTag(tag);
      o.setTimeout(config_.timeout);
      gloo::broadcast(o);
    });
  }

  Work all_to_all(const at::Tensor& out, const at::Tensor& in, const AllToAllOptions& opts) override {
    auto what = summary("all_to_all", in);
    what.in = in.numel(), what.out = out.numel();
    return enqueue(what, {out, in}, [this, out, in, opts](uint32_t tag) {
      const int64_t esize = out.element_size();
      if (opts.in_splits.empty()) {
        if (in.numel() == 0) return;
        gloo::AlltoallOptions o(context_);
        o.setInput(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
        o.setOutput(static_cast<uint8_t*>(out.data_ptr()), out.nbytes());
        o.setTag(tag);
        o.setTimeout(config_.timeout);
        gloo::alltoall(o);
        return;
      }
      auto to_bytes = [&](const std::vector<int64_t>& v) {
        std::vector<int64_t> b(v.size());
        for (size_t i = 0; i < v.size(); ++i) b[i] = v[i] * esize;
        return b;
      };
      // gloo wants a valid pointer even for an empty side; a one-byte scratch serves.
      uint8_t scratch = 0;
      auto ptr = [&](const at::Tensor& t) {
        return t.numel() ? static_cast<uint8_t*>(t.data_ptr()) : &scratch;
      };
      gloo::AlltoallvOptions o(context_);
      o.setInput(ptr(in), to_bytes(opts.in_splits));
      o.setOutput(ptr(out), to_bytes(opts.out_splits));
      o.setTag(tag);
      o.setTimeout(config_.timeout);
      gloo::alltoallv(o);
    });
  }

  Work p2p(const std::vector<P2POp>& ops) override { return post_p2p(ops); }

  Work barrier() override {
    return enqueue(OpSummary{.op = "barrier", .rank = rank_, .size = size_}, {}, [this](uint32_t tag) {
      if (size_ == 1) return;
      gloo::BarrierOptions o(context_);
      o.setTag(tag);
      o.setTimeout(config_.timeout);
      gloo::barrier(o);
    });
  }

  std::shared_ptr<CommImpl> split(int color, int key) override {
    const int seq = split_seq_++;
    auto mine = at::tensor({int64_t{color}, int64_t{key}}, at::kLong);
    auto all = at::empty({2 * size_}, at::kLong);
    all_gather(all, mine, {}).wait();
    if (color < 0) return nullptr;
    const auto* v = all.data_ptr<int64_t>();
    std::vector<std::pair<int64_t, int>> members;  // (key, parent rank)
    for (int r = 0; r < size_; ++r)
      if (v[2 * r] == color) members.emplace_back(v[2 * r + 1], r);
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    while (members[new_rank].second != rank_) ++new_rank;
    const int new_size = static_cast<int>(members.size());
    auto store = make_prefix_store(fmt::format("split{}/color{}", seq, color), store_);
    join(*store, new_rank, new_size, config_.timeout);
    return make_comm(std::move(store), new_rank, new_size, config_);
  }

 private:
  struct Task {
    std::shared_ptr<WorkState> state;
    // Returns false when the operation completes elsewhere (point-to-point).
    std::function<bool(uint32_t tag)> run;
    // A collective takes the next tag. Point-to-point operations take none: ranks issue different
    // numbers of them, and the tags of the collectives after them must still agree.
    bool collective = true;
  };

  // Alone in the group, every collective is a local copy: run it here rather than pay two thread
  // hand-offs. Nothing else can be queued (send/recv to self are rejected). What comes back is an
  // empty Work, completed, which costs no allocation (the flight recorder notes the time). Only a
  // failure needs a state, to carry it to wait(). The all-gather and reduce-scatter that FSDP
  // issues per unit come here before making the worker's closure, which would copy their tensors.
  template <typename F>
  Work alone(const OpSummary& what, F&& body) {
    try {
      body();
      return Work();
    } catch (...) {
      auto state = std::make_shared<WorkState>(what);
      state->error = std::current_exception();
      state->finished_at = std::chrono::system_clock::now();
      state->done = true;
      return Work(state);
    }
  }

  // An all-gather or a reduce-scatter over one rank: out is in (contiguous CPU tensors of one dtype
  // and size, Comm checked).
  static void copy_alone(const at::Tensor& out, const at::Tensor& in) {
    void* to = out.data_ptr();
    const void* from = in.const_data_ptr();
    if (from != to && out.nbytes() > 0) std::memcpy(to, from, out.nbytes());
  }

  OpSummary summary(const char* op, const at::Tensor& t) const {
    return {.op = op, .rank = rank_, .size = size_, .dtype = t.scalar_type()};
  }

  template <typename F>
  Work enqueue(const OpSummary& what, std::initializer_list<at::Tensor> tensors, F&& body) {
    if (size_ == 1) return alone(what, [&] { body(0); });
    auto state = std::make_shared<WorkState>(what);
    state->tensors.assign(tensors);
    push({state, [body = std::forward<F>(body)](uint32_t tag) {
            body(tag);
            return true;
          }});
    return Work(state);
  }

  void push(Task task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  void run_worker() {
    uint32_t tag = 0;
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything issued has run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      if (broken_) {
        task.state->finish(broken_);
        continue;
      }
      try {
        task.state->start();
        if (task.run(task.collective ? tag++ : 0)) task.state->finish();
      } catch (...) {
        // A failed gloo operation leaves the context unusable; later operations fail fast with
        // the original cause instead of hanging.
        broken_ = std::current_exception();
        note_failure(task.state->what(), broken_);
        task.state->finish(broken_);
      }
    }
  }

  // Gloo's sends and receives are asynchronous: every operation of a group is posted at once, so
  // a group needs nothing more than one Work over all of them.
  Work post_p2p(const std::vector<P2POp>& ops) {
    std::string what = fmt::format("rank {}/{} ", rank_, size_);
    for (size_t i = 0; i < ops.size(); ++i) what += (i ? ", " : "") + ops[i].describe();
    auto state = std::make_shared<WorkState>(std::move(what));
    std::vector<P2POp> posted;
    for (const auto& op : ops)
      if (op.tensor.numel() > 0) posted.push_back(op), state->tensors.push_back(op.tensor);
    if (posted.empty()) {
      state->finish();
      return Work(state);
    }
    push({state,
          [this, posted = std::move(posted), state](uint32_t) mutable {
            P2pGroup group{{}, {}, state};
            for (const auto& op : posted) {
              const auto& t = op.tensor;
              auto buf = context_->createUnboundBuffer(t.data_ptr(), t.nbytes());
              const auto slot = gloo::Slot::build(kPointToPointSlotPrefix, op.tag);
              const bool is_send = op.kind == P2POp::Kind::kSend;
              if (is_send)
                buf->send(op.peer, slot, 0, t.nbytes());
              else
                buf->recv(op.peer, slot, 0, t.nbytes());
              group.buffers.push_back(std::move(buf));
              group.is_send.push_back(is_send);
            }
            // From here the state holds the tensors until the operation is done; the worker,
            // which may get to destroy this closure only later, must not (Note [received tensors]).
            posted.clear();
            start_waiter(std::move(group));
            return false;
          },
          false});
    return Work(state);
  }

  void start_waiter(P2pGroup group) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread thread([this, group = std::move(group), done]() mutable {
      try {
        for (size_t i = 0; i < group.buffers.size(); ++i) {
          if (group.is_send[i])
            group.buffers[i]->waitSend(config_.timeout);
          else
            group.buffers[i]->waitRecv(config_.timeout);
        }
        group.state->finish();
      } catch (...) {
        note_failure(group.state->what(), std::current_exception());
        group.state->finish(std::current_exception());
      }
      done->store(true);
    });
    std::lock_guard<std::mutex> lock(waiters_mu_);
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
    waiters_.push_back({std::move(thread), std::move(done)});
  }

  // Position p on the ring, taken modulo the size into [0, size): the rings count back from a rank.
  int ring_pos(int p) const { return ((p % size_) + size_) % size_; }

  // Ring all-gather over gloo's transport, in place: this rank's piece already sits at its slot of
  // `out`. At step s rank r forwards piece (r - s) to rank r + 1 and receives piece (r - s - 1)
  // from rank r - 1, which it forwards at the next step.
  void ring_all_gather(const at::Tensor& out, size_t piece, uint32_t tag) {
    const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    const auto slot = gloo::Slot::build(kAllGatherSlotPrefix, tag);
    auto buf = context_->createUnboundBuffer(out.data_ptr(), out.nbytes());
    auto offset = [&](int p) { return static_cast<size_t>(ring_pos(p)) * piece; };
    for (int s = 0; s < size_ - 1; ++s) {
      buf->send(right, slot, offset(rank_ - s), piece);
      buf->recv(left, slot, offset(rank_ - s - 1), piece);
      buf->waitRecv(config_.timeout);
      buf->waitSend(config_.timeout);
    }
  }

  // Ring reduce-scatter over gloo's transport. At step s rank r sends its partial sum of chunk
  // (r - s - 1) to rank r + 1 and adds its own contribution to the partial of chunk (r - s - 2)
  // that arrives from rank r - 1; its last addition, the full sum of chunk r, goes straight into
  // `out`. Each chunk is reduced in one fixed order, so the result does not depend on timing.
  // 16-bit dtypes accumulate in float32, and their partial sums travel in float32. The first hop
  // carries a rank's own values, which the input's dtype holds exactly, so it travels in that
  // dtype: half the bytes, the same result (at 2 ranks, the only hop).
  void ring_reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op, uint32_t tag) {
    const int64_t n = out.numel();
    if (n == 0) return;  // one rank never comes here (reduce_scatter and all_reduce take it apart)
    const bool widened = is_half(in.scalar_type());
    const auto acc_type = widened ? at::kFloat : in.scalar_type();
    const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    const auto slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    const auto chunk = [&](int c) { return in.narrow(0, ring_pos(c) * n, n); };
    // Two partial-sum buffers: one is being sent while the other receives.
    const size_t bytes = n * c10::elementSize(acc_type);
    at::Tensor bufs[2] = {at::empty({n}, in.options().dtype(acc_type)),
                          at::empty({n}, in.options().dtype(acc_type))};
    std::unique_ptr<gloo::transport::UnboundBuffer> ub[2] = {
        context_->createUnboundBuffer(bufs[0].data_ptr(), bytes),
        context_->createUnboundBuffer(bufs[1].data_ptr(), bytes)};
    // The first hop, in the input's dtype: this rank's chunk out, the left neighbour's in.
    const at::Tensor first = chunk(rank_ - 1);
    const at::Tensor first_in = widened ? at::empty({n}, in.options()) : at::Tensor();
    const size_t first_bytes = first.nbytes();
    auto first_ub = context_->createUnboundBuffer(first.data_ptr(), first_bytes);
    auto first_in_ub = widened ? context_->createUnboundBuffer(first_in.data_ptr(), first_bytes) : nullptr;
    first_ub->send(right, slot, 0, first_bytes);
    bool send_pending[2] = {false, false};
    dispatch(in.scalar_type(), [&]<typename In>() {
      using Acc =
          std::conditional_t<std::is_same_v<In, c10::BFloat16> || std::is_same_v<In, c10::Half>, float, In>;
      for (int s = 0; s < size_ - 1; ++s) {
        const int b = s % 2;
        auto* sum = bufs[b].data_ptr<Acc>();
        const In* mine = chunk(rank_ - s - 2).const_data_ptr<In>();
        // A gloo buffer takes one operation at a time: the send it started two steps ago must
        // have left before it receives again.
        if (send_pending[b]) ub[b]->waitSend(config_.timeout);
        // The last hop writes the result into `out`, an average divided there. `out` may be this
        // rank's own chunk of `in` (all_reduce): each element is read before it is written.
        const bool last = s == size_ - 2;
        auto add = [&](const auto* arrived) {
          if (last)
            combine<Acc>(op, out.data_ptr<In>(), arrived, mine, n, op == ReduceOp::kAvg ? size_ : 0);
          else
            combine<Acc>(op, sum, arrived, mine, n);
        };
        if (s == 0 && widened) {
          first_in_ub->recv(left, slot, 0, first_bytes);
          first_in_ub->waitRecv(config_.timeout);
          add(first_in.const_data_ptr<In>());
        } else {
          ub[b]->recv(left, slot, 0, bytes);
          ub[b]->waitRecv(config_.timeout);
          add(sum);
        }
        send_pending[b] = s < size_ - 2;
        if (send_pending[b]) ub[b]->send(right, slot, 0, bytes);
      }
    });
    first_ub->waitSend(config_.timeout);
    for (int b = 0; b < 2; ++b)
      if (send_pending[b]) ub[b]->waitSend(config_.timeout);
  }

  std::shared_ptr<Store> store_;
  const int rank_, size_;
  const BackendConfig config_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  int split_seq_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::exception_ptr broken_;  // touched only by the worker thread
  std::thread worker_;

  struct Waiter {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex waiters_mu_;
  std::vector<Waiter> waiters_;
};

std::shared_ptr<CommImpl> make_comm(std::shared_ptr<Store> store, int rank, int size,
                                    const BackendConfig& config) {
  return std::make_shared<GlooComm>(std::move(store), rank, size, config);
}

const char* bound_gloo_library() {
  static const std::string path = [] {
    Dl_info info{};
    const auto fn = static_cast<void (*)(const gloo::AllreduceOptions&)>(&gloo::allreduce);
    return dladdr(reinterpret_cast<void*>(fn), &info) && info.dli_fname ? std::string(info.dli_fname)
                                                                        : std::string("unknown");
  }();
  return path.c_str();
}

}  // namespace

}  // namespace fsdpp::comm::detail

extern "C" __attribute__((visibility("default"))) const fsdpp::comm::detail::GlooPlugin* fsdpp_gloo_plugin() {
  static const fsdpp::comm::detail::GlooPlugin plugin{fsdpp::comm::detail::make_comm,
                                                      fsdpp::comm::detail::bound_gloo_library};
  return &plugin;
}
