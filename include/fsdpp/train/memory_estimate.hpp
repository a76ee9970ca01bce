#pragma once
// How much memory one rank of a recipe needs, estimated before anything is allocated, and how much
// the machine has: `fsdpp validate` and `fsdpp run` refuse a recipe that cannot fit instead of
// letting an allocation fail mid-run.
//
// Per rank: sharded parameters, their gradients and AdamW's two moments in float32 (this rank's
// share of its pipeline stage); the parameters gathered for compute, with their unsharded gradients
// (one block at a time when blocks reshard after forward, the whole stage otherwise); activations
// kept for backward (per microbatch in flight: per token and layer the attention's and the
// feed-forward's saved tensors, or only each block's input under full activation checkpointing);
// the logits of the last stage; a fixed allowance for LibTorch, communication buffers and the
// allocator. An estimate, deliberately on the high side of what a run measures (summary.json's
// peak_rss_mib), good to tell "cannot fit" from "fits".

#include <optional>
#include <string>

namespace fsdpp::train {

struct Recipe;

struct MemoryEstimate {
  double parameters = 0, gradients = 0, optimizer = 0, gathered = 0, activations = 0, logits = 0,
         overhead = 0;  // bytes
  double total() const {
    return parameters + gradients + optimizer + gathered + activations + logits + overhead;
  }
  // "3.2 GiB per rank (sharded parameters 0.1 GiB, gradients ..., ...)"
  std::string describe() const;
};

MemoryEstimate estimate_memory(const Recipe& recipe);

// The memory one rank may use on this machine: with train.device "cpu", the machine's memory
// (MemTotal) divided among `local_ranks`; with "cuda", one GPU's. Empty where it cannot be told (a
// GPU recipe on a machine without a GPU); `what` then says why, else what was measured.
std::optional<double> memory_per_rank(const Recipe& recipe, int local_ranks, std::string* what);

// Refuses (std::invalid_argument) a recipe whose estimate exceeds what each of `local_ranks` ranks
// has here, naming both and the largest parts. Returns a line for the user: the estimate and the
// machine's memory, or the estimate alone where the machine's cannot be told.
std::string check_memory(const Recipe& recipe, int local_ranks);

}  // namespace fsdpp::train
