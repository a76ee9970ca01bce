#pragma once
// Sharded checkpoints of a fully_shard model (and of AdamW's state for it), loadable at any world
// size. Each rank writes its rows of every parameter to <dir>/rank<r>.safetensors (tensor "<name>",
// and "<name>.exp_avg" / "<name>.exp_avg_sq" for the optimizer) with an index <dir>/rank<r>.json
// (name, global shape, first row, row count, dtype, optimizer step); loading reads every index and
// takes the rows this rank now owns, wherever they were saved. Files are written under a temporary
// name and renamed, so a crash never leaves a half-written file under the final name. Each index
// records its tensor file's size and CRC-32C, and every reader checks them: a damaged byte anywhere
// in the file is an error naming the file, never wrong numbers.

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "fsdpp/fsdp/fully_shard.hpp"

namespace fsdpp::fsdp {

class AdamW;

// Every rank calls it with the same directory (which it creates). With HSDP
// (FullyShardOptions::replicate) the first replica group writes the one copy.
void save_sharded(UnitHolder& root, const std::string& dir, AdamW* optimizer = nullptr);

// Throws naming the directory, file or parameter when something is missing or inconsistent.
void load_sharded(UnitHolder& root, const std::string& dir, AdamW* optimizer = nullptr);

// The same for a model made of several sharded roots (pipeline stages): `shards` are this rank's,
// from all of its roots; `rank` of `world` names the files. Neither synchronises.
void write_shard_files(const std::vector<Shard>& shards, int rank, int world, const std::string& dir,
                       AdamW* optimizer = nullptr);
// The roots must be resharded (their sharded parameters are written).
// `present_only`: read only the ranks' files present in `dir` (one node's directory of a checkpoint
// on local storage); the rows this rank owns must be among them.
void read_shard_files(const std::vector<Shard>& shards, const std::string& dir, AdamW* optimizer = nullptr,
                      bool present_only = false);

// Checks every rank's files of a checkpoint (sizes and checksums, each index against its tensors)
// without a model, one rank's file in memory at a time. Throws naming the file and the damage.
void verify_sharded(const std::string& dir, bool present_only = false);

// Every parameter in full, assembled from all ranks' files of a checkpoint, in index order. One
// process; throws naming the file or parameter when rows are missing or inconsistent.
// `dirs`: one checkpoint directory, or the directories of every node of a checkpoint on local
// storage (each rank's files are taken from whichever holds them).
std::vector<std::pair<std::string, at::Tensor>> read_full_parameters(const std::vector<std::string>& dirs);
inline std::vector<std::pair<std::string, at::Tensor>> read_full_parameters(const std::string& dir) {
  return read_full_parameters(std::vector<std::string>{dir});
}

}  // namespace fsdpp::fsdp
