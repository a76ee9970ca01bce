#pragma once
// The launcher behind `fsdpp launch`: starts the local ranks of one node with torchrun's
// environment variables, prefixes their output lines with their rank, and makes the whole group
// fail fast: when one rank fails, the others are stopped (SIGTERM, then SIGKILL after a grace
// period) and the first failure's exit code is returned, or, with max_restarts, the group is
// started again.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdpp::comm {

struct LaunchOptions {
  int nproc = 1;  // ranks on this node
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;           // empty: 127.0.0.1 (single node only)
  uint16_t master_port = 0;          // 0: a free port (single node only)
  std::vector<std::string> command;  // program and its arguments
  // NAME=value entries for every rank's environment, each replacing the launcher's own NAME.
  std::vector<std::string> env;
  std::chrono::milliseconds stop_grace = std::chrono::seconds(5);  // SIGTERM to SIGKILL
  bool prefix_output = true;
  // After a failure (once every rank is stopped), start the whole group again, up to this many
  // times. Ranks see the attempt in TORCHELASTIC_RESTART_COUNT, as under torchrun's
  // --max-restarts; `fsdpp run` then resumes from the latest checkpoint. With several nodes the
  // launchers agree through the store: a failure on one node restarts every node.
  int max_restarts = 0;
  // The node's ranks share GPUs (more ranks than GPUs; rank r uses GPU LOCAL_RANK % count). NCCL
  // refuses two ranks of one communicator on one GPU of one host, so each rank is given an
  // NCCL_HOSTID of its own: NCCL then takes the ranks for separate hosts and connects them over
  // its socket transport on loopback (NCCL_SOCKET_IFNAME=lo and NCCL_IB_DISABLE=1, unless set).
  // For correctness checks on a machine with fewer GPUs than ranks: the ranks' contexts share
  // the GPU, so timings mean little. Single node only.
  bool share_gpu = false;
};

struct LaunchResult {
  int exit_code = 0;     // 0, the first failing rank's exit code, or 128 + its signal
  int failed_rank = -1;  // global rank; -1 when all succeeded or the failure was on another node
  std::string reason;    // "rank 1 (pid 123) was killed by signal 9 (SIGKILL)"
  int restarts = 0;      // how many times the group was started again
};

// Runs the ranks to completion. Throws std::invalid_argument for inconsistent options. Installs
// SIGINT/SIGTERM handlers for its duration, so Ctrl-C stops every rank.
LaunchResult launch(const LaunchOptions& options);

}  // namespace fsdpp::comm
