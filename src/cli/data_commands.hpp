#pragma once
// `fsdpp tokenizer train` and `fsdpp tokenize`: from raw text to a tokenizer and token shards.

#include <CLI/CLI.hpp>
#include <memory>

namespace fsdpp::cli {

struct DataCommands;

// Adds the two commands to `app`; the returned object holds their options.
std::shared_ptr<DataCommands> add_data_commands(CLI::App& app);

// Runs whichever of them was given; returns its exit status, or -1 when neither was.
int run_data_commands(const DataCommands& commands);

}  // namespace fsdpp::cli
