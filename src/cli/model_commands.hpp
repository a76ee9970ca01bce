#pragma once
// `fsdpp export` and `fsdpp import`: a trained model out to, and in from, the layout Hugging Face
// transformers reads and writes (train/hf.hpp).

#include <CLI/CLI.hpp>
#include <memory>

namespace fsdpp::cli {

struct ModelCommands;

// Adds the two commands to `app`; the returned object holds their options.
std::shared_ptr<ModelCommands> add_model_commands(CLI::App& app);

// Runs whichever of them was given; returns its exit status, or -1 when neither was.
int run_model_commands(const ModelCommands& commands);

}  // namespace fsdpp::cli
