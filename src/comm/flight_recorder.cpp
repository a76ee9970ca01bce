#include "fsdpp/comm/flight_recorder.hpp"

#include "fsdpp/base/files.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "fsdpp/comm/store.hpp"
#include "backend.hpp"

namespace fsdpp::comm {

namespace {

const std::string kNoLabel;
// Read and set around every collective. libfsdpp is linked, not dlopen'ed, so the static TLS model
// serves: a fixed offset from the thread pointer instead of a __tls_get_addr call.
[[gnu::tls_model("initial-exec")]] thread_local const std::string* t_label = &kNoLabel;

int64_t micros(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

std::mutex g_mu;
std::vector<std::weak_ptr<FlightRecorder>> g_recorders;

std::vector<std::shared_ptr<FlightRecorder>> live_recorders() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::shared_ptr<FlightRecorder>> out;
  g_recorders.erase(std::remove_if(g_recorders.begin(), g_recorders.end(),
                                   [&](const std::weak_ptr<FlightRecorder>& w) {
                                     auto p = w.lock();
                                     if (p) out.push_back(p);
                                     return !p;
                                   }),
                    g_recorders.end());
  return out;
}

size_t capacity_from_env() {
  const char* v = std::getenv("FSDPP_FR_SIZE");
  return v && *v ? std::max<long>(0, std::atol(v)) : 2000;
}

}  // namespace

OpLabel::OpLabel(std::string label) : owned_(std::move(label)), previous_(t_label) { t_label = &owned_; }
OpLabel::OpLabel(const std::string* label) : previous_(t_label) { t_label = label; }
OpLabel::~OpLabel() { t_label = previous_; }
const std::string& OpLabel::current() { return *t_label; }

FlightRecorder::FlightRecorder(std::string name, int rank, int size, size_t capacity)
    : name_(std::move(name)), rank_(rank), size_(size), capacity_(capacity) {}

std::string FlightRecorder::child_name(int color) {
  std::lock_guard<SpinLock> lock(mu_);
  return fmt::format("{}/split{}.{}", name_, splits_++, color);
}

void FlightRecorder::record(const char* op, const at::Tensor* in, const at::Tensor* out, int peer,
                            const Work& work, std::chrono::system_clock::time_point issued) {
  if (capacity_ == 0) return;
  const at::Tensor* t = in ? in : out;
  using Clock = std::chrono::system_clock;
  // An empty Work is an operation that had completed by now.
  const Clock::time_point completed = work.state() ? Clock::time_point{} : Clock::now();
  if (issued == Clock::time_point{}) issued = work.state() ? Clock::now() : completed;
  std::lock_guard<SpinLock> lock(mu_);
  FlightEntry* e;
  if (entries_.size() < capacity_) {
    e = &entries_.emplace_back();
  } else {
    e = &entries_[first_];
    first_ = (first_ + 1) % entries_.size();
  }
  e->seq = next_seq_++;
  e->op = op;
  e->dtype = t ? c10::toString(t->scalar_type()) : "";
  e->in_numel = in ? in->numel() : 0;
  e->out_numel = out ? out->numel() : 0;
  e->peer = peer;
  e->label.assign(OpLabel::current());
  e->issued = issued;
  e->work = work.state();
  e->completed = completed;
}

std::string FlightRecorder::overdue(std::chrono::milliseconds timeout) const {
  const auto now = std::chrono::system_clock::now();
  std::lock_guard<SpinLock> lock(mu_);
  std::string found;
  for_each_entry([&](const FlightEntry& e) {
    if (found.empty() && e.work && !Work(e.work).is_completed() && now - e.issued > timeout)
      found = fmt::format("{} seq {} {} {} in={} out={}{} ('{}')", name_, e.seq, e.op, e.dtype, e.in_numel,
                          e.out_numel, e.peer >= 0 ? fmt::format(" peer={}", e.peer) : "", e.label);
  });
  return found;
}

std::string FlightRecorder::to_json() const {
  nlohmann::json entries = nlohmann::json::array();
  std::lock_guard<SpinLock> lock(mu_);
  for_each_entry([&](const FlightEntry& e) {
    const bool done = !e.work || Work(e.work).is_completed();
    bool failed = false, started = !e.work;
    std::chrono::system_clock::time_point started_at;
    if (e.work) {
      std::lock_guard<std::mutex> wl(e.work->mu);
      failed = done && e.work->error != nullptr;
      started = e.work->started || done;
      started_at = e.work->started_at;
    }
    const char* state = failed ? "failed" : done ? "completed" : started ? "started" : "queued";
    nlohmann::json j = {{"seq", e.seq},     {"op", e.op},         {"dtype", e.dtype},
                        {"in", e.in_numel}, {"out", e.out_numel}, {"peer", e.peer},
                        {"label", e.label}, {"state", state},     {"issued_us", micros(e.issued)}};
    if (e.work && started && started_at.time_since_epoch().count() != 0) j["started_us"] = micros(started_at);
    if (done && e.work) j["completed_us"] = micros(e.work->finished_at);
    if (!e.work && e.completed.time_since_epoch().count() != 0) {  // completed where it was issued
      j["started_us"] = micros(e.issued);
      j["completed_us"] = micros(e.completed);
    }
    entries.push_back(std::move(j));
  });
  return nlohmann::json{{"comm", name_}, {"rank", rank_}, {"size", size_}, {"entries", entries}}.dump();
}

namespace detail {

std::shared_ptr<FlightRecorder> make_recorder(const std::string& name, int rank, int size) {
  auto r = std::make_shared<FlightRecorder>(name, rank, size, capacity_from_env());
  std::lock_guard<std::mutex> lock(g_mu);
  g_recorders.push_back(r);
  return r;
}

}  // namespace detail

std::string flight_records_json() {
  nlohmann::json comms = nlohmann::json::array();
  for (const auto& r : live_recorders()) comms.push_back(nlohmann::json::parse(r->to_json()));
  return comms.dump();
}

std::string dump_flight_records(const std::string& dir, int world_rank) {
  std::filesystem::create_directories(dir);
  const auto comms = nlohmann::json::parse(flight_records_json());
  const auto path = (std::filesystem::path(dir) / fmt::format("rank{}.json", world_rank)).string();
  write_file_atomically(
      path,
      nlohmann::json{{"format", "fsdpp-flight-records-1"}, {"rank", world_rank}, {"comms", comms}}.dump(1));
  return path;
}

// ------------------------------------------------------------------ analysis

namespace {

struct Seen {
  int world_rank;
  nlohmann::json entry;  // null when the rank has no entry at that sequence number
};

std::string describe_entry(const nlohmann::json& e) {
  std::string s = fmt::format("{} {} in={} out={}", e["op"].get<std::string>(), e["dtype"].get<std::string>(),
                              e["in"].get<int64_t>(), e["out"].get<int64_t>());
  if (e["peer"].get<int>() >= 0) s += fmt::format(" peer={}", e["peer"].get<int>());
  if (!e["label"].get<std::string>().empty()) s += fmt::format(" ('{}')", e["label"].get<std::string>());
  return s;
}

std::string signature(const nlohmann::json& e) {
  if (e.is_null()) return "";
  // Point-to-point peers differ by design. Collectives must agree on everything, the label that
  // says what issued them included: two ranks in different layers have lost step.
  const std::string op = e["op"].get<std::string>();
  if (op == "send" || op == "recv") return "p2p";
  return fmt::format("{} {} {} {} {}", op, e["dtype"].get<std::string>(), e["in"].get<int64_t>(),
                     e["out"].get<int64_t>(), e["label"].get<std::string>());
}

std::string rank_list(const std::vector<int>& r) { return fmt::format("{}", fmt::join(r, ", ")); }

}  // namespace

std::string analyze_flight_records(const std::string& dir, bool* found) {
  if (found) *found = false;
  std::map<std::string, std::map<int, std::pair<int, std::map<int64_t, nlohmann::json>>>>
      comms;  // name -> comm rank -> (world rank, seq -> entry)
  std::map<std::string, int> sizes;
  std::set<int> dumped;  // world ranks
  int dumps = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    const auto name = f.path().filename().string();
    if (name.rfind("rank", 0) != 0 || f.path().extension() != ".json") continue;
    std::ifstream in(f.path());
    nlohmann::json d;
    try {
      d = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      throw CommError(fmt::format("fr analyze: {} is not a flight record: {}", f.path().string(), e.what()));
    }
    ++dumps;
    const int world_rank = d.at("rank").get<int>();
    dumped.insert(world_rank);
    for (const auto& c : d.at("comms")) {
      auto& slot = comms[c.at("comm").get<std::string>()][c.at("rank").get<int>()];
      slot.first = world_rank;
      for (const auto& e : c.at("entries")) slot.second[e.at("seq").get<int64_t>()] = e;
      sizes[c.at("comm").get<std::string>()] = c.at("size").get<int>();
    }
  }
  if (dumps == 0) throw CommError("fr analyze: no rank*.json flight records in " + dir);
  std::string report = fmt::format("{} rank dump(s) in {}\n", dumps, dir);
  // A rank that wrote nothing could not: stopped, stuck outside a collective, or dead. Every other
  // rank waits on it, so it is the first place to look.
  const int world = sizes.count("world") ? sizes["world"] : 0;
  std::vector<int> silent;
  for (int r = 0; r < world; ++r)
    if (!dumped.count(r)) silent.push_back(r);
  if (!silent.empty()) {
    report += fmt::format(
        "rank(s) {} of {} wrote no flight records: a rank that is stopped (SIGSTOP, a debugger), stuck "
        "outside a collective, or dead cannot dump, and every other rank waits on it: the likely "
        "culprit\n",
        rank_list(silent), world);
    if (found) *found = true;
  }
  for (const auto& [comm, ranks] : comms) {
    if (static_cast<int>(ranks.size()) < sizes[comm])
      report += fmt::format("{}: only {} of {} ranks dumped\n", comm, ranks.size(), sizes[comm]);
    int64_t lo = 0, hi = -1;
    for (const auto& [r, v] : ranks)
      if (!v.second.empty()) {
        lo = std::max(lo, v.second.begin()->first);  // older entries may have left the ring
        hi = std::max(hi, v.second.rbegin()->first);
      }
    for (int64_t seq = lo; seq <= hi; ++seq) {
      std::map<std::string, std::vector<int>> by_sig;
      std::map<std::string, nlohmann::json> example;
      for (const auto& [r, v] : ranks) {
        auto it = v.second.find(seq);
        const auto e = it == v.second.end() ? nlohmann::json() : it->second;
        by_sig[signature(e)].push_back(v.first);
        if (!e.is_null()) example[signature(e)] = e;
      }
      if (by_sig.size() == 1) continue;
      // The largest group is taken as what should have happened.
      auto majority = std::max_element(by_sig.begin(), by_sig.end(), [](const auto& a, const auto& b) {
        return a.second.size() < b.second.size() || (a.second.size() == b.second.size() && a.first.empty());
      });
      const std::string want = majority->first.empty() ? "nothing" : describe_entry(example[majority->first]);
      for (const auto& [sig, who] : by_sig) {
        if (sig == majority->first) continue;
        if (sig.empty()) {
          report += fmt::format("{}: rank(s) {} never issued operation {}, which rank(s) {} issued: {}\n",
                                comm, rank_list(who), seq, rank_list(majority->second), want);
        } else {
          report +=
              fmt::format("{}: at operation {}, rank(s) {} issued {} where rank(s) {} issued {}\n", comm, seq,
                          rank_list(who), describe_entry(example[sig]), rank_list(majority->second), want);
        }
      }
      if (found) *found = true;
      return report;
    }
  }
  report += silent.empty() ? "no disagreement: every rank issued the same operations in the same order\n"
                           : "no disagreement among the ranks that dumped\n";
  return report;
}

// ------------------------------------------------------------------ watchdog

namespace {

struct Watchdog {
  std::mutex mu;
  WatchdogOptions options;
  std::thread thread;
  std::atomic<bool> stop{false};
  bool dumped = false;

  void run() {
    while (!stop.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::lock_guard<std::mutex> lock(mu);
      if (dumped) continue;
      std::string why;
      for (const auto& r : live_recorders())
        if (auto o = r->overdue(options.timeout); !o.empty()) {
          why = fmt::format("{} has been in flight for over {:.1f} s", o, options.timeout.count() / 1000.0);
          break;
        }
      try {
        if (why.empty() && options.store && options.store->check({"dump"}))
          why = "another rank asked for flight records";
        if (why.empty()) continue;
        if (options.store) options.store->set("dump", std::vector<uint8_t>{1});
      } catch (const std::exception&) {
        if (why.empty()) continue;  // the store may be gone at shutdown
      }
      const auto path = dump_flight_records(options.dump_dir, options.rank);
      std::cerr << fmt::format("fsdpp watchdog: rank {}: {}; flight records written to {}\n", options.rank,
                               why, path);
      dumped = true;
      if (options.exit_code != 0) {
        std::this_thread::sleep_for(options.exit_grace);
        std::cerr << fmt::format(
                         "fsdpp watchdog: rank {}: ending the process (exit code {}); analyse with: fsdpp fr "
                         "analyze {}\n",
                         options.rank, options.exit_code, options.dump_dir)
                  << std::flush;
        // NCCL operations stuck on the device would keep the process from ending.
        detail::run_abort_hooks();
        std::_Exit(options.exit_code);
      }
    }
  }
};

Watchdog& watchdog() {
  static Watchdog* w = new Watchdog;  // outlives static destruction; the thread is stopped first
  return *w;
}

}  // namespace

void start_watchdog(const WatchdogOptions& options) {
  auto& w = watchdog();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.options = options;
    w.dumped = false;
  }
  if (!w.thread.joinable()) {
    w.stop = false;
    w.thread = std::thread([&w] { w.run(); });
    std::atexit([] { stop_watchdog(); });
  }
}

void stop_watchdog() {
  auto& w = watchdog();
  w.stop = true;
  if (w.thread.joinable()) w.thread.join();
  std::lock_guard<std::mutex> lock(w.mu);
  auto& o = w.options;
  try {
    if (o.store) {
      constexpr const char* kStopped = "watchdogs_stopped";  // how many ranks' watchdogs have stopped
      int64_t stopped = o.store->add(kStopped, 1);
      const auto deadline = std::chrono::steady_clock::now() + o.hosted_grace;
      while (o.hosted && stopped < o.world_size && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        stopped = o.store->add(kStopped, 0);
      }
    }
  } catch (const std::exception&) {
    // The store is gone already (its host ended first); nothing is left to wait for.
  }
  o.store.reset();
  o.hosted.reset();
}

}  // namespace fsdpp::comm
