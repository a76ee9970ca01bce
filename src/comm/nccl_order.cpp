// The NCCL-order check: a CPU communicator that keeps NCCL's ordering rules, so that the CPU tests
// find what would hang only on NCCL (Note [point-to-point groups] in fsdpp/comm/comm.hpp).
//
// Note [NCCL order on the CPU]
// A decorator over a Gloo communicator. Its operations run one at a time, in issue order, on one
// queue (a worker thread), as an NCCL communicator's operations run on its stream:
//  - a collective starts when it reaches the head of the queue and completes once every rank's
//    queue has reached it (Gloo's collectives need every rank);
//  - a send or a receive first meets its peer: each side announces the operation (tag, dtype,
//    element count) and waits for the other side's announcement, which the peer makes only when
//    that operation is at the head of its own queue; then the data moves. So a send never
//    completes before the peer's receive has started, which NCCL allows for any message size;
//  - a group (batch_p2p) announces all its operations at once and completes when all have.
// Announcements pair in order per direction, as NCCL pairs messages (it has no tags): a pair whose
// tags, dtypes or sizes differ fails on both sides, naming both operations.
// A head that has waited for a second publishes in the store what it waits at. When the heads it
// waits for are not its counterparts and wait too, across two readings, none of them can ever
// go on (each head changes only by completing): the operation fails, describing every such head,
// and so does every later operation of the communicator. A wait that is not such a cycle (a rank
// whose program is busy elsewhere) fails after the communicator's timeout, naming the heads.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "backend.hpp"

namespace fsdpp::comm::detail {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPublishAfter = std::chrono::milliseconds(1000);
constexpr auto kRereadAfter = std::chrono::milliseconds(300);
// The inner communicator's tags (NCCL order pairs by order, so the caller's tags only get compared).
constexpr uint32_t kSenderAnnounces = 1, kReceiverAnnounces = 2, kData = 3;

// What a rank's head of queue is, as other ranks read it from the store: "C<k>:<op>" for its k-th
// collective, "S<peer>.<k>" / "R<peer>.<k>" for its k-th send to / receive from a peer.
struct Head {
  bool waiting = false;
  int64_t index = -1;  // the operation's position in the rank's queue
  std::vector<std::string> keys;
  std::string description;

  std::string encode() const {
    return fmt::format("{} {} {}|{}", waiting ? 'W' : 'I', index, fmt::join(keys, " "), description);
  }
  static Head decode(const std::string& s) {
    Head h;
    const auto bar = s.find('|');
    std::istringstream in(s.substr(0, bar));
    std::string state;
    in >> state >> h.index;
    h.waiting = state == "W";
    for (std::string k; in >> k;) h.keys.push_back(k);
    if (bar != std::string::npos) h.description = s.substr(bar + 1);
    return h;
  }
  bool has(const std::string& key) const { return std::find(keys.begin(), keys.end(), key) != keys.end(); }
  bool same_as(const Head& o) const { return waiting == o.waiting && index == o.index; }
};

// The ranks whose heads `mine` (rank `me`) waits for, and which are not its counterparts.
std::set<int> waits_for(int me, const Head& mine, const std::map<int, Head>& heads, int size) {
  std::set<int> out;
  for (const auto& key : mine.keys) {
    if (key[0] == 'C') {
      for (int q = 0; q < size; ++q)
        if (q != me && (!heads.count(q) || !heads.at(q).has(key))) out.insert(q);
      continue;
    }
    const auto dot = key.find('.');
    const int peer = std::stoi(key.substr(1, dot - 1));
    const std::string counterpart = fmt::format("{}{}{}", key[0] == 'S' ? 'R' : 'S', me, key.substr(dot));
    if (!heads.count(peer) || !heads.at(peer).has(counterpart)) out.insert(peer);
  }
  return out;
}

struct Item {
  std::shared_ptr<WorkState> state;
  std::vector<std::string> keys;  // given by push()
  std::string description;
  std::vector<at::Tensor> tensors;
  std::function<Work()> collective;  // or:
  std::vector<P2POp> ops;
};

class NcclOrderComm final : public CommImpl {
 public:
  NcclOrderComm(std::shared_ptr<CommImpl> inner, std::shared_ptr<Store> store,
                std::chrono::milliseconds timeout)
      : inner_(std::move(inner)), store_(std::move(store)), timeout_(timeout) {
    publish(Head{});
    worker_ = std::thread([this] { run(); });
  }
  ~NcclOrderComm() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend() const override { return inner_->backend(); }

  Work all_gather(const at::Tensor& out, const at::Tensor& in, const AllGatherOptions& opts) override {
    return collective(
        fmt::format("all_gather {} in={} out={}", c10::toString(in.scalar_type()), in.numel(), out.numel()),
        {out, in}, [=, this] { return inner_->all_gather(out, in, opts); });
  }
  Work reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                      const ReduceScatterOptions& opts) override {
    return collective(fmt::format("reduce_scatter {} {} in={} out={}", c10::toString(in.scalar_type()),
                                  to_string(opts.op), in.numel(), out.numel()),
                      {out, in}, [=, this] { return inner_->reduce_scatter(out, in, opts); });
  }
  Work all_reduce(const at::Tensor& t, const AllReduceOptions& opts) override {
    return collective(
        fmt::format("all_reduce {} {} n={}", c10::toString(t.scalar_type()), to_string(opts.op), t.numel()),
        {t}, [=, this] { return inner_->all_reduce(t, opts); });
  }
  Work broadcast(const at::Tensor& t, const BroadcastOptions& opts) override {
    return collective(
        fmt::format("broadcast {} root={} n={}", c10::toString(t.scalar_type()), opts.root, t.numel()), {t},
        [=, this] { return inner_->broadcast(t, opts); });
  }
  Work all_to_all(const at::Tensor& out, const at::Tensor& in, const AllToAllOptions& opts) override {
    return collective(
        fmt::format("all_to_all {} in={} out={}", c10::toString(in.scalar_type()), in.numel(), out.numel()),
        {out, in}, [=, this] { return inner_->all_to_all(out, in, opts); });
  }
  Work barrier() override {
    return collective("barrier", {}, [this] { return inner_->barrier(); });
  }

  Work p2p(const std::vector<P2POp>& ops) override {
    Item item;
    std::vector<std::string> parts;
    for (const auto& op : ops) {
      parts.push_back(op.describe());
      item.tensors.push_back(op.tensor);
    }
    item.description = parts.size() == 1 ? parts[0] : fmt::format("group of {}", fmt::join(parts, ", "));
    item.ops = ops;
    return push(std::move(item));
  }

  std::shared_ptr<CommImpl> split(int color, int key) override {
    // ncclCommSplit is a host-side collective, outside the stream's order; the inner
    // communicator's split is a collective on it, so nothing of this queue may run meanwhile.
    drain();
    const int seq = splits_++;
    auto child = inner_->split(color, key);
    if (!child) return nullptr;
    return std::make_shared<NcclOrderComm>(
        std::move(child), make_prefix_store(fmt::format("split{}/color{}", seq, color), store_), timeout_);
  }

 private:
  Work collective(std::string description, std::initializer_list<at::Tensor> tensors,
                  std::function<Work()> issue) {
    Item item;
    item.description = std::move(description);
    item.collective = std::move(issue);
    item.tensors.assign(tensors);
    return push(std::move(item));
  }

  Work push(Item item) {
    item.state = std::make_shared<WorkState>(fmt::format("rank {}/{} {}", rank(), size(), item.description));
    item.state->tensors = item.tensors;
    Work work(item.state);
    {
      std::lock_guard<std::mutex> lock(mu_);
      // What the head will announce: issue order, counted where the order is decided.
      if (item.collective)
        item.keys.push_back(
            fmt::format("C{}:{}", collectives_++, item.description.substr(0, item.description.find(' '))));
      for (const auto& op : item.ops) {
        const bool send = op.kind == P2POp::Kind::kSend;
        item.keys.push_back(
            fmt::format("{}{}.{}", send ? 'S' : 'R', op.peer, (send ? sends_ : receives_)[op.peer]++));
      }
      queue_.push_back(std::move(item));
    }
    cv_.notify_all();
    return work;
  }

  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }

  void run() {
    for (int64_t index = 0;; ++index) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        busy_ = false;
        cv_.notify_all();
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      // The operation's tensors go with its end: a caller woken by finish() may drop its own
      // references at once, and this thread must not be the one still holding them.
      auto finish = [&item](std::exception_ptr failure = nullptr) {
        item.ops.clear();
        item.tensors.clear();
        item.collective = nullptr;
        item.state->finish(std::move(failure));
      };
      if (broken_) {
        finish(broken_);
        continue;
      }
      Head head{true, index, item.keys, item.description};
      item.state->start();
      try {
        if (item.collective)
          await(item.collective(), head);
        else
          exchange(item.ops, head);
        if (published_) publish(Head{false, index, {}, ""});
        finish();
      } catch (...) {
        // The head stays published as waiting: it never completes, and the peers in its cycle must
        // still see it so.
        broken_ = std::current_exception();
        note_failure(item.state->what(), broken_);
        finish(broken_);
      }
    }
  }

  // A send or receive group: announcements, a comparison, then the data.
  void exchange(const std::vector<P2POp>& ops, const Head& head) {
    std::vector<at::Tensor> mine, theirs;
    std::vector<P2POp> announce, data;
    for (const auto& op : ops) {
      const bool send = op.kind == P2POp::Kind::kSend;
      auto m = at::tensor({int64_t(op.tag), int64_t(op.tensor.scalar_type()), op.tensor.numel()}, at::kLong);
      auto t = at::empty({3}, at::kLong);
      announce.push_back(P2POp::send(m, op.peer, send ? kSenderAnnounces : kReceiverAnnounces));
      announce.push_back(P2POp::recv(t, op.peer, send ? kReceiverAnnounces : kSenderAnnounces));
      mine.push_back(m), theirs.push_back(t);
      if (op.tensor.numel() > 0)
        data.push_back(op.kind == P2POp::Kind::kSend ? P2POp::send(op.tensor, op.peer, kData)
                                                     : P2POp::recv(op.tensor, op.peer, kData));
    }
    await(inner_->p2p(announce), head);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (at::equal(mine[i], theirs[i])) continue;
      const bool send = ops[i].kind == P2POp::Kind::kSend;
      const auto* o = theirs[i].data_ptr<int64_t>();
      throw CommError(fmt::format(
          "NCCL order (FSDPP_CHECK_NCCL_ORDER): this {} rank {} (tag {}, {}, {} elements) pairs, in NCCL's "
          "issue "
          "order, with rank {}'s {} rank {} (tag {}, {}, {} elements). NCCL matches sends and receives "
          "between two "
          "ranks by their order on the communicator, not by tag: issue them in the same order on both sides",
          send ? "send to" : "recv from", ops[i].peer, ops[i].tag, c10::toString(ops[i].tensor.scalar_type()),
          ops[i].tensor.numel(), ops[i].peer, send ? "recv from" : "send to", rank(), o[0],
          c10::toString(static_cast<at::ScalarType>(o[1])), o[2]));
    }
    if (!data.empty()) await(inner_->p2p(data), head);
  }

  // Waits for an operation of the inner communicator, watching for a wait that cannot end.
  void await(const Work& work, const Head& head) {
    if (const auto& st = work.state()) {
      const auto start = Clock::now();
      std::optional<std::map<int, Head>> last;
      auto next_look = start + kPublishAfter;
      std::unique_lock<std::mutex> lock(st->mu);
      while (!st->cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return st->done; })) {
        const auto now = Clock::now();
        if (now < next_look) continue;
        lock.unlock();
        if (!published_) publish(head);
        next_look = now + kRereadAfter;
        const auto heads = read_heads();
        if (last) check_deadlock(head, *last, heads);
        last = heads;
        if (now - start > timeout_)
          throw CommError(fmt::format("NCCL order (FSDPP_CHECK_NCCL_ORDER): waited {:.0f} s at {}; {}",
                                      std::chrono::duration<double>(now - start).count(), head.description,
                                      describe(heads)));
        lock.lock();
      }
    }
    work.wait();
  }

  void publish(const Head& head) {
    const auto text = head.encode();
    store_->set(fmt::format("head/{}", rank()), std::vector<uint8_t>(text.begin(), text.end()));
    published_ = head.waiting;
  }

  std::map<int, Head> read_heads() {
    std::map<int, Head> heads;
    for (int q = 0; q < size(); ++q) {
      const auto key = fmt::format("head/{}", q);
      if (!store_->check({key})) continue;
      const auto v = store_->get(key);
      heads[q] = Head::decode(std::string(v.begin(), v.end()));
    }
    return heads;
  }

  // Fails when this rank's head belongs to a set of waiting heads each of which waits for another
  // in the set (the greatest such set), unchanged since the previous reading.
  void check_deadlock(const Head& mine, const std::map<int, Head>& before, std::map<int, Head> now) const {
    now[rank()] = mine;
    std::set<int> stuck;
    for (const auto& [q, h] : now)
      if (h.waiting && (q == rank() || (before.count(q) && before.at(q).same_as(h)))) stuck.insert(q);
    for (bool changed = true; changed;) {
      changed = false;
      for (auto it = stuck.begin(); it != stuck.end();) {
        const auto w = waits_for(*it, now.at(*it), now, size());
        const bool on_stuck = std::any_of(w.begin(), w.end(), [&](int q) { return stuck.count(q) > 0; });
        if (on_stuck) {
          ++it;
        } else {
          it = stuck.erase(it);
          changed = true;
        }
      }
    }
    if (!stuck.count(rank())) return;
    std::vector<std::string> lines;
    for (int q : stuck) {
      const auto w = waits_for(q, now.at(q), now, size());
      lines.push_back(fmt::format("rank {} waits at its operation {} ({}) for rank(s) {}", q, now.at(q).index,
                                  now.at(q).description, fmt::join(w, ", ")));
    }
    throw CommError(
        fmt::format("NCCL order (FSDPP_CHECK_NCCL_ORDER): a wait that can never end, on NCCL a hang: {}. "
                    "Each rank runs a "
                    "communicator's operations in the order it issued them; sends and receives that must "
                    "progress together "
                    "belong in one Comm::batch_p2p group",
                    fmt::join(lines, "; ")));
  }

  std::string describe(const std::map<int, Head>& heads) const {
    std::vector<std::string> parts;
    for (const auto& [q, h] : heads)
      parts.push_back(h.waiting ? fmt::format("rank {} waits at {}", q, h.description)
                                : fmt::format("rank {} waits at nothing", q));
    return parts.empty() ? std::string("no other rank's head is known")
                         : fmt::format("{}", fmt::join(parts, "; "));
  }

  std::shared_ptr<CommImpl> inner_;
  std::shared_ptr<Store> store_;
  const std::chrono::milliseconds timeout_;
  int splits_ = 0;

  std::mutex mu_;  // guards the queue and the counters of what each head announces
  int64_t collectives_ = 0;
  std::map<int, int64_t> sends_, receives_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false, busy_ = false;
  // The worker's own.
  std::exception_ptr broken_;
  bool published_ = false;
  std::thread worker_;
};

}  // namespace

std::shared_ptr<CommImpl> make_nccl_order_comm(std::shared_ptr<CommImpl> inner, std::shared_ptr<Store> store,
                                               std::chrono::milliseconds timeout) {
  if (inner->size() == 1) return inner;
  return std::make_shared<NcclOrderComm>(std::move(inner), make_prefix_store("nccl-order", std::move(store)),
                                         timeout);
}

}  // namespace fsdpp::comm::detail
