#pragma once
// The command line's smaller commands and what its commands share: `fsdpp demo`'s worker,
// `fsdpp schedule show`, `fsdpp ckpt verify`, `fsdpp ls`, the exit codes and the executable's path.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdpp::cli {

// Exit codes (docs/cli.md): 0 done; 1 the command failed (a run diverged, a file is damaged, a rank
// died); 2 bad input (a recipe, an option, an argument), nothing started; under `fsdpp launch` and
// `fsdpp run`, the first failing rank's code: 124 when its watchdog ended a collective that never
// completed, 128 + N when signal N killed it.
inline constexpr int kExitFailed = 1;
inline constexpr int kExitBadInput = 2;

// This executable's path (/proc/self/exe), for starting ranks of it.
std::string self_exe();

// The demo job's worker: checks an all-reduce against its closed form, then prints the all-reduce
// bandwidth table on rank 0.
int demo_worker(int64_t max_bytes);

struct ShowOptions {
  std::string schedule, csv, out;  // out: a prefix of files to write; empty: print only
  int pp = 2, microbatches = 4, max_outstanding_sends = 0, max_active_stages = 3;
  std::string unshard_lookahead = "full";
  std::optional<int> stages_per_rank;  // unset: 2 for V schedules, else 1
  bool fsdp = false, defer_reduce_grad_wait = false, defer_pp_recv = false;
  std::vector<double> costs{1, 2, 1, 1};
};

// Validates and simulates a schedule; prints the timeline and bubbles; with --out, also writes an
// SVG, a trace and the action tables.
int schedule_show(const ShowOptions& o);

// `fsdpp ckpt verify`: one checkpoint, or every committed checkpoint of a run directory, newest
// first. Exit 1 when any is damaged.
int verify_checkpoints(std::string path);

// `fsdpp ls`: the bundled recipes and model configs, each with a line about it.
int list_bundled();

}  // namespace fsdpp::cli
