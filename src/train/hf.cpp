#include "fsdpp/train/hf.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <set>
#include <stdexcept>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/safetensors.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "hf_tensors.hpp"
#include "hf_tokenizer.hpp"

namespace fsdpp::train::hf {

namespace fs = std::filesystem;
using nlohmann::json;

bool is_checkpoint_dir(const std::string& path) {
  std::error_code ec;
  // A config.json of any kind: reading it then says what is wrong with one that is not a file.
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / "config.json", ec);
}

std::vector<std::string> export_checkpoint(const models::MoEConfig& c, const NamedTensors& state,
                                           const Tokenizer* tokenizer, const std::string& dir,
                                           const ExportOptions& options) {
  std::error_code ec;
  if (fs::exists(dir, ec) || fs::is_symlink(dir, ec))
    throw std::invalid_argument(fmt::format("export: {} exists; name a new directory", dir));
  const auto dtype = options.dtype.value_or(state.empty() ? at::kFloat : state.front().second.scalar_type());
  json config = export_config(c, dtype);  // refuses before anything is written
  // Converted one tensor at a time as it is written, so that only one converted copy is held.
  const auto tensors = detail::to_hf_views(c, state);
  const auto write = [&](const fs::path& file, size_t first, size_t last) {
    std::vector<TensorSpec> specs;
    for (size_t i = first; i < last; ++i)
      specs.push_back({tensors[i].first, dtype, tensors[i].second.sizes().vec()});
    write_safetensors(file.string(), specs,
                      [&](size_t i) { return tensors[first + i].second.to(at::kCPU, dtype).contiguous(); },
                      {{"format", "pt"}});
  };
  if (tokenizer && tokenizer->vocab_size() > c.vocab_size)
    throw std::invalid_argument(fmt::format("export: the tokenizer has {} tokens, the model {}",
                                            tokenizer->vocab_size(), c.vocab_size));

  const fs::path final_dir(dir);
  const fs::path tmp =
      final_dir.parent_path() / fmt::format(".{}.tmp-{}", final_dir.filename().string(), getpid());
  std::vector<std::string> files;
  try {
    // The target's folder first, so that a read-only or missing place is named as the user gave it
    // (not as the temporary directory beside it).
    if (const auto parent = final_dir.parent_path(); !parent.empty()) fs::create_directories(parent);
    if (::access((final_dir.parent_path().empty() ? fs::path(".") : final_dir.parent_path()).c_str(), W_OK) !=
        0)
      throw std::runtime_error(fmt::format("export: cannot write {}: {}", dir, os_error(errno)));
    fs::create_directories(tmp);
    const auto write_json = [&](const std::string& name, const json& j) {
      write_file_atomically((tmp / name).string(), j.dump(2) + "\n");
      files.push_back(name);
    };
    // The tokenizer's end-of-text token ends a generation, as in `fsdpp generate`.
    const json eos = tokenizer && tokenizer->eot() >= 0 ? json(tokenizer->eot()) : json();
    config["eos_token_id"] = eos;
    write_json("config.json", config);
    write_json("generation_config.json",
               {{"bos_token_id", nullptr}, {"eos_token_id", eos}, {"pad_token_id", nullptr}});
    // Shards in order, each up to the limit (a tensor larger than it has a file to itself).
    std::vector<std::pair<size_t, size_t>> shards;  // [first, last) tensor indexes
    uint64_t bytes = 0, total = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const uint64_t b = tensors[i].second.numel() * at::elementSize(dtype);
      if (shards.empty() || (bytes > 0 && bytes + b > options.max_shard_bytes)) {
        shards.emplace_back(i, i);
        bytes = 0;
      }
      shards.back().second = i + 1;
      bytes += b;
      total += b;
    }
    if (shards.size() <= 1) {
      write(tmp / "model.safetensors", 0, tensors.size());
      files.push_back("model.safetensors");
    } else {
      json weight_map = json::object();
      for (size_t s = 0; s < shards.size(); ++s) {
        const auto name = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
        for (size_t i = shards[s].first; i < shards[s].second; ++i) weight_map[tensors[i].first] = name;
        write(tmp / name, shards[s].first, shards[s].second);
        files.push_back(name);
      }
      write_json("model.safetensors.index.json",
                 {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
    }
    if (tokenizer) {
      const bool bytes = tokenizer->spec() == "bytes", published = !tokenizer->tokenizer_json().empty();
      const json tj = bytes       ? detail::bytes_tokenizer_json()
                      : published ? read_json_file(tokenizer->tokenizer_json())
                                  : detail::piece_tokenizer_json(tokenizer->spec());
      if (published) {  // byte for byte: its digest is the tokenizer's identity
        fs::copy_file(tokenizer->tokenizer_json(), tmp / "tokenizer.json");
        files.push_back("tokenizer.json");
      } else {
        write_json("tokenizer.json", tj);
      }
      json tc = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                 {"model_max_length", c.max_seq_len},
                 {"clean_up_tokenization_spaces", false}};
      if (published) {
        // The rest of the source's tokenizer configuration (its chat template, its special tokens).
        const auto from = fs::path(tokenizer->tokenizer_json()).parent_path();
        if (fs::is_regular_file(from / "tokenizer_config.json", ec))
          tc = read_json_file((from / "tokenizer_config.json").string());
        if (fs::is_regular_file(from / "chat_template.jinja", ec)) {
          fs::copy_file(from / "chat_template.jinja", tmp / "chat_template.jinja");
          files.push_back("chat_template.jinja");
        }
        for (const auto& t : tj.value("added_tokens", json::array()))
          if (t.value("id", -1) == tokenizer->eot() && !tc.contains("eos_token"))
            tc["eos_token"] = t["content"];
      } else if (!bytes) {
        // The model file too, so that import finds fsdpp's tokenizer again.
        fs::copy_file(tokenizer->spec(), tmp / "tokenizer.model");
        files.push_back("tokenizer.model");
        for (const auto& t : tj["added_tokens"])
          if (t["id"] == tokenizer->eot()) tc["eos_token"] = t["content"];
      }
      write_json("tokenizer_config.json", tc);
    }
    sync_to_disk(tmp.string());
    fs::rename(tmp, final_dir);
    sync_to_disk(final_dir.parent_path().empty() ? "." : final_dir.parent_path().string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return files;
}

Imported import_checkpoint(const std::string& dir) {
  auto lazy = import_checkpoint_lazy(dir);
  Imported r{lazy.config, {}, lazy.tokenizer};
  for (const auto& t : lazy.tensors) r.state.emplace_back(t.name, t.make());
  return r;
}

LazyImport import_checkpoint_lazy(const std::string& dir) {
  const fs::path d(dir);
  const auto config_path = (d / "config.json").string();
  LazyImport r;
  r.config = import_config(read_json_file(config_path), config_path);
  NamedTensors hf;
  const auto index_path = d / "model.safetensors.index.json";
  std::error_code ec;
  std::string source;
  if (fs::exists(index_path, ec)) {
    source = index_path.string();
    const json index = read_json_file(source);
    if (!index.contains("weight_map") || !index["weight_map"].is_object())
      throw std::invalid_argument(fmt::format("{}: no weight_map object", source));
    std::map<std::string, std::set<std::string>> by_file;
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string() || fs::path(file.get<std::string>()).has_parent_path())
        throw std::invalid_argument(
            fmt::format("{}: {} maps to {}, not a file name", source, name, file.dump()));
      by_file[file.get<std::string>()].insert(name);
    }
    for (auto& [file, names] : by_file) {
      const auto path = (d / file).string();
      auto part = read_safetensors(path, /*mapped=*/true);
      for (auto& [name, t] : part.tensors) {
        if (!names.erase(name))
          throw std::invalid_argument(
              fmt::format("{}: holds {}, which {} does not map to it", path, name, source));
        hf.emplace_back(name, std::move(t));
      }
      if (!names.empty())
        throw std::invalid_argument(fmt::format("{}: {} maps {} to {}, which does not hold it", source,
                                                source, *names.begin(), path));
    }
  } else if (fs::exists(d / "model.safetensors", ec)) {
    source = (d / "model.safetensors").string();
    hf = std::move(read_safetensors(source, /*mapped=*/true).tensors);
  } else {
    throw std::invalid_argument(fmt::format(
        "{}: no model.safetensors or model.safetensors.index.json (fsdpp reads safetensors weights; "
        "save_pretrained writes them by default)",
        dir));
  }
  r.tensors = detail::from_hf_lazy(r.config, hf, source);
  // The tokenizer, where fsdpp reads it; otherwise a note of why not (the weights come in anyway).
  std::vector<std::string> why;
  const auto tok = d / "tokenizer.json";
  if (fs::exists(tok, ec)) {
    try {
      const json t = read_json_file(tok.string());
      r.tokenizer = detail::is_bytes_tokenizer(t)
                        ? Tokenizer::load("bytes")->identity()
                        : Tokenizer::load(fs::absolute(tok).lexically_normal().string())->identity();
    } catch (const std::exception& e) {
      why.push_back(e.what());
    }
  }
  if (r.tokenizer.is_null() && fs::exists(d / "tokenizer.model", ec)) {
    try {  // a SentencePiece model fsdpp reads (as `fsdpp export` leaves one)
      r.tokenizer = Tokenizer::load((d / "tokenizer.model").string())->identity();
    } catch (const std::exception& e) {
      why.push_back(e.what());
    }
  }
  if (r.tokenizer.is_null() && !why.empty())
    r.tokenizer_note = fmt::format("no tokenizer taken: {}", fmt::join(why, "; "));
  return r;
}

}  // namespace fsdpp::train::hf
