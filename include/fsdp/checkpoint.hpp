#pragma once
// Sharded checkpoints of a fully_shard model (and of AdamW's state for it), loadable at any world
// size. Each rank writes its rows of every parameter to <dir>/rank<r>.pt with an index
// <dir>/rank<r>.json (name, global shape, first row, row count, dtype); loading reads every index
// and takes the rows this rank now owns, wherever they were saved. Files are written under a
// temporary name and renamed, so a crash never leaves a half-written file under the final name.

#include <string>

#include "fsdp/fully_shard.hpp"

namespace torch::optim {
class AdamW;
}

namespace fsdpp::fsdp {

// Every rank calls it with the same directory (which it creates).
void save_sharded(UnitHolder& root, const std::string& dir, torch::optim::AdamW* optimizer = nullptr);

// Throws naming the directory, file or parameter when something is missing or inconsistent.
void load_sharded(UnitHolder& root, const std::string& dir, torch::optim::AdamW* optimizer = nullptr);

}  // namespace fsdpp::fsdp
