#pragma once
// A run's claim on its output directory: one run writes into a directory at a time, so that two
// runs given the same logging.output_dir cannot mix their metrics and checkpoints.
//
// The claim is an exclusive flock(2) on <dir>/.fsdpp-run.lock, held for the run's life by the
// process that manages the directory (`fsdpp run`'s launcher, or under another launcher the rank
// that manages it), and released by the kernel however that process ends. The file says who holds
// it (pid, host, start time, command), for the message another run gets. A file that still names a
// holder when the lock is free was left by a run that was killed: it is taken over, with a note.

#include <optional>
#include <string>

namespace fsdpp::train {

class RunLock {
 public:
  // Creates `dir` if needed and claims it. Throws std::runtime_error naming the run that holds it
  // ("runs/x is in use by another run: pid 1234 on host h, started 2026-12-06 16:01:02 UTC (fsdpp
  // run recipes/moe-small.json); wait for it to end or set another logging.output_dir").
  // `took_over` receives a description of a claim left by a run that ended without releasing it.
  static RunLock acquire(const std::string& dir, const std::string& command,
                         std::optional<std::string>* took_over = nullptr);
  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&& other) noexcept;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  // Ends the claim: the file is emptied, then unlocked.
  ~RunLock();

  static constexpr const char* kFileName = ".fsdpp-run.lock";
  // Set in the environment of ranks whose launcher holds the claim, so they do not claim again.
  static constexpr const char* kHeldVariable = "FSDPP_RUN_LOCK_HELD";

 private:
  explicit RunLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace fsdpp::train
