#pragma once
// Flight recorder: every communicator keeps a ring buffer of its recent operations (sequence
// number, operation, dtype, element counts, peer, state, times, and a label of what issued it), so
// that a hang or a mismatch can be traced to the rank and the operation after the fact.
//
//   { comm::OpLabel label("fsdp all_gather layers.3"); comm.all_gather(out, in); }
//   comm::dump_flight_records(dir);   // this rank's recorders -> <dir>/rank<R>.json
//   fsdpp fr analyze <dir>            // names the culprit across all ranks' dumps
//
// A watchdog (start_watchdog, or FSDPP_WATCHDOG_TIMEOUT_S with FSDPP_FR_DUMP_DIR under
// init_from_env) notices an operation in flight longer than its timeout, dumps this rank's
// records and asks every other rank, through the store, to dump theirs. The operation itself still
// fails at the communicator's timeout.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdpp/base/spin_lock.hpp"
#include "fsdpp/comm/work.hpp"

namespace fsdpp::comm {

class Store;

// Labels the operations issued by this thread while it lives.
class OpLabel {
 public:
  explicit OpLabel(std::string label);
  // Borrows `label`, which must outlive this object (no copy, for hot paths).
  explicit OpLabel(const std::string* label);
  ~OpLabel();
  OpLabel(const OpLabel&) = delete;
  OpLabel& operator=(const OpLabel&) = delete;
  static const std::string& current();

 private:
  std::string owned_;
  const std::string* previous_;
};

struct FlightEntry {
  int64_t seq = 0;
  const char* op = "";     // a static name: "all_gather", ...
  const char* dtype = "";  // c10::toString's static name, or "" without a tensor
  std::string label;
  int64_t in_numel = 0, out_numel = 0;
  int peer = -1;  // send/recv only
  std::chrono::system_clock::time_point issued;
  std::shared_ptr<detail::WorkState> work;  // state and completion time
  // Of an operation that had completed by the time it was recorded (an empty Work: a one-rank
  // collective, done where it was issued).
  std::chrono::system_clock::time_point completed;
};

class FlightRecorder {
 public:
  FlightRecorder(std::string name, int rank, int size, size_t capacity);
  // `issued`: when the caller issued the operation (default: now). An empty `work` is an operation
  // already completed, now.
  void record(const char* op, const at::Tensor* in, const at::Tensor* out, int peer, const Work& work,
              std::chrono::system_clock::time_point issued = {});
  std::string to_json() const;  // the dump format read by `fsdpp fr analyze`
  // The oldest operation in flight for longer than `timeout`, or "".
  std::string overdue(std::chrono::milliseconds timeout) const;
  const std::string& name() const { return name_; }
  // False with a capacity of 0 (FSDPP_FR_SIZE=0): record() keeps nothing.
  bool enabled() const { return capacity_ > 0; }
  // The name of the next sub-communicator split off this one.
  std::string child_name(int color);

 private:
  std::string name_;
  int rank_, size_;
  size_t capacity_;
  int64_t next_seq_ = 0;
  int splits_ = 0;
  mutable SpinLock mu_;  // record() runs for every operation; the watchdog reads too
  // A ring of at most capacity_ entries, the oldest at first_ once full. Entries are overwritten in
  // place, so recording reuses their label strings' storage instead of allocating.
  std::vector<FlightEntry> entries_;
  size_t first_ = 0;
  template <class F>
  void for_each_entry(F&& f) const {  // oldest first; mu_ held
    for (size_t i = 0; i < entries_.size(); ++i) f(entries_[(first_ + i) % entries_.size()]);
  }
};

// Writes every live recorder of this process to <dir>/rank<world_rank>.json. Returns the path.
std::string dump_flight_records(const std::string& dir, int world_rank);

// Every live recorder of this process as a JSON array, in the format dump_flight_records writes
// (operations with their labels and issue / completion times, in microseconds since the epoch).
std::string flight_records_json();

// Reads every rank's dump in `dir` and names the culprit: the first sequence number, on some
// communicator, at which a rank issued nothing or something different from the others. Returns a
// report for people; `found` says whether a culprit was named.
std::string analyze_flight_records(const std::string& dir, bool* found = nullptr);

// The watchdog thread checks every 100 ms whether an operation of any communicator of this process
// has been in flight longer than `timeout`, or whether another rank asked for dumps through the
// store. Then it writes this rank's flight records to `dump_dir`, asks every other rank to do the
// same, and, when `exit_code` is non-zero, ends the process with it after `exit_grace` (time for
// the others to dump). Ending the process is the only way out of a collective that never
// completes: the thread running it is inside the transport, where nothing can unwind it.
struct WatchdogOptions {
  std::chrono::milliseconds timeout = std::chrono::minutes(3);
  std::string dump_dir = "fsdpp-flight-records";
  std::shared_ptr<Store> store;  // to ask the other ranks to dump; optional
  // The store server this process hosts, if any (rank 0 without an agent's store). The watchdogs
  // of all `world_size` ranks poll it: it is kept until this one stops (at the latest when the
  // process exits) and, up to `hosted_grace`, until every rank's watchdog has said through `store`
  // that it stopped, so that no poll finds it gone.
  std::shared_ptr<Store> hosted;
  int world_size = 1;
  std::chrono::milliseconds hosted_grace = std::chrono::seconds(5);
  int rank = 0;
  int exit_code = 0;  // 0: dump only
  std::chrono::milliseconds exit_grace = std::chrono::seconds(2);
};

// The exit code of a process the watchdog ended (as timeout(1) uses).
constexpr int kWatchdogExitCode = 124;

// Starts (or reconfigures) this process's watchdog thread.
void start_watchdog(const WatchdogOptions& options);
// Stops the thread and lets go of the options' stores; at exit if not before.
void stop_watchdog();

namespace detail {
std::shared_ptr<FlightRecorder> make_recorder(const std::string& name, int rank, int size);
}

}  // namespace fsdpp::comm
