#pragma once
// Fault injection, for tests of how failures are handled: FSDPP_FAULT="<kind>:rank=<R>:<at>=<N>",
// R a global rank (RANK). Unset, nothing is injected.
//   skip_all_gather:rank=R:count=N    rank R never issues its N-th labelled all_gather (1-based;
//                                     the ones issued under an OpLabel, such as fully_shard's
//                                     unshards), so the others wait for it: a hang to diagnose
//   kill:rank=R:step=N                the trainer ends rank R with SIGKILL as step N begins
//   kill_in_checkpoint:rank=R:step=N  the trainer ends rank R after it wrote its files of the
//                                     checkpoint at step N, before the checkpoint is committed
// A fault fires on the group's first start only; ":attempt=K" makes it fire on restart K instead
// (TORCHELASTIC_RESTART_COUNT), ":attempt=any" on every start (a failure that restarts cannot cure).
//
// Nothing is injected into a program that does not ask, whatever its environment says: a program
// arms injection with arm_faults_from_env() (the fsdpp CLI and the test programs do), which reads
// FSDPP_FAULT once and returns what it armed, for the program to log.

#include <cstdint>
#include <string>

namespace fsdpp::comm {

struct Fault {
  std::string kind;  // empty: none
  int rank = -1;
  int64_t at = -1;        // count or step
  int attempt = 0;        // the start of the group it fires on; -1: every start
  bool disarmed = false;  // not this start
  // Whether `kind` is due on this rank at `at` (the trainer's kinds).
  bool due(const std::string& k, int rank_now, int64_t at_now) const {
    return !disarmed && kind == k && rank == rank_now && at == at_now;
  }
};

// Reads FSDPP_FAULT (and WORLD_SIZE, RANK, TORCHELASTIC_RESTART_COUNT) and arms the fault it
// names; once per process, later calls return the same. Throws std::invalid_argument naming a
// malformed value, or a rank outside WORLD_SIZE.
const Fault& arm_faults_from_env();
// The armed fault; none (kind empty) until arm_faults_from_env() was called.
const Fault& injected_fault();
// Checks FSDPP_FAULT for a world of `world_size` ranks before they start (`fsdpp run` does), and,
// given the run's last step, a trainer's fault at a step the run never reaches.
void check_injected_fault(int world_size, int64_t last_step = -1);

namespace detail {
// Called by every all_gather: true when this one is to be skipped.
bool skip_this_all_gather();
}  // namespace detail

}  // namespace fsdpp::comm
