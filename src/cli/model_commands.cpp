#include "model_commands.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cctype>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>

#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/train/hf.hpp"
#include "fsdpp/train/model_files.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::cli {

namespace fs = std::filesystem;

struct ModelCommands {
  CLI::App* export_cmd = nullptr;
  CLI::App* import_cmd = nullptr;
  std::string export_in, export_out, format = "hf", dtype, max_shard = "50GB", tokenizer;
  std::string import_in, import_out;
};

namespace {

// "50GB", "200MB", "64KiB", "1000": bytes, as transformers' max_shard_size reads them (decimal
// units, binary ones with an i).
uint64_t parse_size(const std::string& text) {
  size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    throw std::invalid_argument(fmt::format("--max-shard-size: not a size: {}", text));
  }
  std::string unit = text.substr(end);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  static const std::map<std::string, double> units{{"", 1},       {"B", 1},         {"KB", 1e3},
                                                   {"MB", 1e6},   {"GB", 1e9},      {"TB", 1e12},
                                                   {"KIB", 1024}, {"MIB", 1 << 20}, {"GIB", 1 << 30}};
  const auto it = units.find(unit);
  if (it == units.end() || !(value > 0))
    throw std::invalid_argument(
        fmt::format("--max-shard-size: not a size: {} (for example 5GB, 500MB)", text));
  // Past 2^63 bytes the product would not convert (undefined): refused, not wrapped.
  const double bytes = value * it->second;
  if (!(bytes < 0x1p63))
    throw std::invalid_argument(fmt::format("--max-shard-size: {} is past 2^63 bytes (8 EiB)", text));
  return static_cast<uint64_t>(bytes);
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::invalid_argument(fmt::format("--dtype: {} is not float32, bfloat16 or float16", name));
}

}  // namespace

std::shared_ptr<ModelCommands> add_model_commands(CLI::App& app) {
  auto c = std::make_shared<ModelCommands>();
  c->export_cmd = app.add_subcommand(
      "export",
      "write a model as a Hugging Face transformers checkpoint: fsdpp export RUN -o DIR --format hf");
  c->export_cmd
      ->add_option("model", c->export_in, "run directory, checkpoint directory or consolidated .safetensors")
      ->required()
      ->check(CLI::ExistingPath);
  c->export_cmd->add_option("-o,--output", c->export_out, "the directory to write (must not exist)")
      ->required();
  c->export_cmd->add_option("--format", c->format, "hf: transformers' save_pretrained layout")
      ->check(CLI::IsMember({"hf"}));
  c->export_cmd->add_option("--dtype", c->dtype, "float32, bfloat16 or float16 (default: the weights' own)")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}));
  c->export_cmd->add_option("--max-shard-size", c->max_shard,
                            "largest weights file before the weights are split over several, as "
                            "transformers' max_shard_size (default 50GB)");
  c->export_cmd->add_option(
      "--tokenizer", c->tokenizer,
      "the tokenizer (.model, tokenizer.json or its directory), where it has moved since "
      "training");

  c->import_cmd = app.add_subcommand(
      "import",
      "read a Hugging Face transformers checkpoint (llama, mixtral) into one safetensors file of "
      "fsdpp's: fsdpp import DIR -o model.safetensors");
  c->import_cmd->add_option("checkpoint", c->import_in, "directory written by save_pretrained")
      ->required()
      ->check(CLI::ExistingDirectory);
  c->import_cmd
      ->add_option("-o,--output", c->import_out, "the safetensors file to write (for model.init_from)")
      ->required();
  return c;
}

int run_model_commands(const ModelCommands& c) {
  if (c.export_cmd->parsed()) {
    train::hf::ExportOptions options;
    options.max_shard_bytes = parse_size(c.max_shard);
    if (!c.dtype.empty()) options.dtype = parse_dtype(c.dtype);
    // The weights as read (a consolidated file's mapped, not copied): no model is built.
    auto weights = train::read_full_weights(c.export_in);
    const auto& recorded = weights.tokenizer;
    std::shared_ptr<const train::Tokenizer> tokenizer;
    const std::string spec = !c.tokenizer.empty()   ? c.tokenizer
                             : recorded.is_object() ? recorded.value("spec", std::string("bytes"))
                                                    : std::string();
    if (!spec.empty() && spec != "none") {
      tokenizer = train::Tokenizer::load(spec);
      if (recorded.is_object()) tokenizer->check_matches(recorded, c.export_in);
    }
    const auto files =
        train::hf::export_checkpoint(weights.config, weights.state, tokenizer.get(), c.export_out, options);
    std::cout << fmt::format("wrote {}: {}\n", c.export_out, fmt::join(files, ", "));
    if (!tokenizer)
      std::cout << "note: no tokenizer written: none is recorded with the weights (give --tokenizer)\n";
    return 0;
  }
  if (c.import_cmd->parsed()) {
    std::error_code ec;
    if (fs::exists(c.import_out, ec))
      throw std::invalid_argument(fmt::format("import: {} exists; name a new file", c.import_out));
    // Checked whole first, then written one tensor at a time (the checkpoint is mapped, not read).
    auto imported = train::hf::import_checkpoint_lazy(c.import_in);
    std::map<std::string, std::string> meta{{"format", "pt"},
                                            {"fsdpp.model_config", train::to_json(imported.config).dump()}};
    if (!imported.tokenizer.is_null()) meta["fsdpp.tokenizer"] = imported.tokenizer.dump();
    std::vector<TensorSpec> specs;
    for (const auto& t : imported.tensors) specs.push_back({t.name, t.dtype, t.shape});
    write_safetensors(
        c.import_out, specs, [&](size_t i) { return imported.tensors[i].make(); }, meta);
    std::cout << fmt::format("wrote {} from {}: {} tensors, {} parameters; model config {}\n", c.import_out,
                             c.import_in, imported.tensors.size(), imported.config.parameter_count(),
                             train::to_json(imported.config).dump());
    if (!imported.tokenizer_note.empty())
      std::cerr << "fsdpp import: note: " << imported.tokenizer_note << "\n";
    return 0;
  }
  return -1;
}

}  // namespace fsdpp::cli
