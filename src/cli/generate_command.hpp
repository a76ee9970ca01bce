#pragma once
// `fsdpp generate`: sampling from a trained model or a transformers directory, as plain text or
// through the tokenizer's chat template.

#include <CLI/CLI.hpp>
#include <memory>

namespace fsdpp::cli {

struct GenerateCommand;

// Adds the command to `app`; the returned object holds its options.
std::shared_ptr<GenerateCommand> add_generate_command(CLI::App& app);

// Runs it when it was given; returns its exit status, or -1 when it was not.
int run_generate_command(const GenerateCommand& command);

}  // namespace fsdpp::cli
