// Recipes: reading one JSON object into a Recipe, section by section (recipe_sections.cpp), with
// every problem of every section reported together.
#include "fsdpp/train/recipe.hpp"

#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>

#include "fsdpp/base/paths.hpp"
#include "fsdpp/fsdp/mixed_precision.hpp"
#include "fsdpp/models/moe.hpp"
#include "recipe_reader.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace recipe_detail;

namespace {

std::string join_lines(const std::string& source, const std::vector<std::string>& problems) {
  std::string s = fmt::format("{}: {} problem{}", source, problems.size(), problems.size() == 1 ? "" : "s");
  for (const auto& p : problems) s += "\n  " + p;
  return s;
}

void apply_override(json& j, const std::string& text, std::vector<std::string>& problems) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    problems.push_back(fmt::format("override '{}': expected key=value, for example optim.lr=1e-3", text));
    return;
  }
  const std::string key = text.substr(0, eq), value = text.substr(eq + 1);
  json parsed;
  try {
    parsed = json::parse(value);
  } catch (const json::exception&) {
    parsed = value;  // a bare word is a string
  }
  json* node = &j;
  size_t start = 0;
  std::string walked;
  for (;;) {
    const size_t dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) {
      problems.push_back(fmt::format("override '{}': empty key component", text));
      return;
    }
    if (!node->is_object()) {
      problems.push_back(fmt::format("override '{}': {} is not an object", text, walked));
      return;
    }
    walked += (walked.empty() ? "" : ".") + part;
    if (dot == std::string::npos) {
      (*node)[part] = parsed;
      return;
    }
    node = &(*node)[part];
    if (node->is_null()) *node = json::object();
    start = dot + 1;
  }
}

}  // namespace

namespace recipe_detail {

std::string resolve(const std::string& p, const std::string& base_dir) {
  if (fs::path(p).is_absolute()) return p;
  const auto rel = fs::path(base_dir) / p;
  std::error_code ec;  // (a name too long for the file system is simply not there)
  if (fs::exists(rel, ec)) return rel.lexically_normal().string();
  return p;  // relative to the working directory
}

json read_json_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    const auto kind = kind_of(fs::status(path, ec).type());
    throw RecipeError(
        path, {fmt::format("cannot read this {} file: {}", what,
                           kind == "missing" ? "no such file" : "it is " + kind + ", not a regular file")});
  }
  if (fs::file_size(path, ec) > (64u << 20))
    throw RecipeError(path, {fmt::format("this {} file is over 64 MiB", what)});
  std::ifstream f(path);
  if (!f) throw RecipeError(path, {fmt::format("cannot read this {} file", what)});
  // JSON leaves a repeated key's meaning open (the parser keeps the last); a recipe says one thing.
  std::vector<std::set<std::string>> keys;  // of each object being parsed
  std::vector<std::string> where;           // the path to it
  std::string last_key, repeated;
  const auto seen = [&](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        where.push_back(last_key);
        keys.emplace_back();
        last_key.clear();
        break;
      case json::parse_event_t::object_end:
        last_key = where.back();  // the name of this object, for its sibling in an array
        keys.pop_back();
        where.pop_back();
        break;
      case json::parse_event_t::key:
        last_key = parsed.get<std::string>();
        if (!keys.empty() && !keys.back().insert(last_key).second && repeated.empty()) {
          for (size_t i = 1; i < where.size(); ++i) repeated += where[i] + ".";
          repeated += last_key;
        }
        break;
      default:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(f, seen);
  } catch (const json::exception& e) {
    throw RecipeError(path, {fmt::format("not valid JSON: {}", e.what())});
  }
  if (!repeated.empty())
    throw RecipeError(path, {fmt::format("{}: given twice in this {} file (JSON would keep only the last)",
                                         repeated, what)});
  return j;
}

}  // namespace recipe_detail

const char* name_of(DataSource v) {
  switch (v) {
    case DataSource::kFortunes:
      return "fortunes";
    case DataSource::kFiles:
      return "files";
    case DataSource::kSynthetic:
      return "synthetic";
    case DataSource::kShards:
      return "shards";
    case DataSource::kChat:
      return "chat";
  }
  return "?";
}
const char* name_of(Device v) { return v == Device::kCuda ? "cuda" : "cpu"; }
const char* name_of(CheckpointStorage v) { return v == CheckpointStorage::kLocal ? "local" : "shared"; }
const char* name_of(MetricsRanks v) {
  switch (v) {
    case MetricsRanks::kRank0:
      return "rank0";
    case MetricsRanks::kAll:
      return "all";
    case MetricsRanks::kNone:
      return "none";
  }
  return "?";
}

RecipeError::RecipeError(std::string source, std::vector<std::string> problems)
    : std::invalid_argument(join_lines(source, problems)), problems_(std::move(problems)) {}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string Recipe::output_dir() const {
  std::string s = logging.output_dir;
  for (size_t p; (p = s.find("{name}")) != std::string::npos;) s.replace(p, 6, name);
  return s;
}

int64_t Recipe::micro_batch() const {
  return train.global_batch /
         (parallel.dp * train.grad_accum * (parallel.pp > 1 ? parallel.microbatches : 1));
}

models::MoEConfig parse_model_config(const json& j, const std::string& source) {
  std::vector<std::string> problems;
  models::MoEConfig c;
  {
    Reader r(&j, "", problems);
    read_model(r, c);
  }
  if (!problems.empty()) throw RecipeError(source, problems);
  return c;
}

json to_json(const models::MoEConfig& c) {
  json j = {{"vocab_size", c.vocab_size},
            {"dim", c.dim},
            {"layers", c.layers},
            {"heads", c.heads},
            {"max_seq_len", c.max_seq_len},
            {"ffn_hidden", c.ffn_hidden},
            {"dense_layers", c.dense_layers},
            {"experts", c.experts},
            {"top_k", c.top_k},
            {"expert_hidden", c.expert_hidden},
            {"shared_expert", c.shared_expert},
            {"score", c.score},
            {"normalize_top_k", c.normalize_top_k},
            {"routing", c.routing},
            {"capacity_factor", c.capacity_factor},
            {"aux_loss_coef", c.aux_loss_coef},
            {"z_loss_coef", c.z_loss_coef},
            {"rope_theta", c.rope_theta},
            {"norm_eps", c.norm_eps},
            {"init_std", c.init_std}};
  // Written only when set, so that the descriptions of models without them stay as they were.
  if (c.kv_heads > 0 && c.kv_heads != c.heads) j["kv_heads"] = c.kv_heads;
  if (c.tie_embeddings) j["tie_embeddings"] = true;
  if (c.head_size > 0) j["head_dim"] = c.head_size;
  if (c.qkv_bias) j["qkv_bias"] = true;
  if (c.qk_norm != "none") j["qk_norm"] = c.qk_norm;
  if (c.moe_step != 1) j["moe_step"] = c.moe_step;
  if (c.shared_expert_hidden > 0) j["shared_expert_hidden"] = c.shared_expert_hidden;
  if (c.shared_expert_gate) j["shared_expert_gate"] = true;
  if (!c.mlp_only_layers.empty()) j["mlp_only_layers"] = c.mlp_only_layers;
  if (c.sliding_window > 0) j["sliding_window"] = c.sliding_window;
  if (c.rope_type != "default") {
    j["rope_type"] = c.rope_type;
    j["rope_factor"] = c.rope_factor;
    if (c.rope_type == "llama3") {
      j["rope_low_freq_factor"] = c.rope_low_freq_factor;
      j["rope_high_freq_factor"] = c.rope_high_freq_factor;
      j["rope_original_max_seq_len"] = c.rope_original_max_seq_len;
    }
  }
  return j;
}

Recipe parse_recipe(json j, const std::string& source, const std::string& base_dir,
                    const std::vector<std::string>& overrides, std::optional<int> world_size) {
  std::vector<std::string> problems;
  if (!j.is_object())
    throw RecipeError(source, {fmt::format("a recipe is a JSON object, got {}", type_name(j))});
  // A model given by path becomes inline, so that overrides such as model.dim=256 reach it: in the
  // file, relative to the recipe; as an override (model=configs/x.json), to the working directory.
  const auto inline_model = [&](const std::string& dir) {
    if (!j.contains("model") || !j["model"].is_string()) return;
    const auto path = resolve(j["model"].get<std::string>(), dir);
    try {
      j["model"] = read_json_file(path, "model config");
    } catch (const RecipeError& e) {
      throw RecipeError(source, {fmt::format("model: {}: {}", path, e.problems().front())});
    }
  };
  inline_model(base_dir);
  for (const auto& o : overrides) {
    apply_override(j, o, problems);
    if (o.rfind("model=", 0) == 0) inline_model(fs::current_path().string());
  }
  if (!problems.empty()) throw RecipeError(source, problems);

  // The sections in the order their rules need each other (data checks against the model, train
  // against the model's routing, ...); every problem of every section is collected.
  using Section = void (*)(Reader&, Recipe&, const std::string&);
  static constexpr Section kSections[] = {read_model_section, read_data,  read_parallel, read_precision,
                                          read_optim,         read_train, read_eval,     read_checkpoint,
                                          read_logging,       read_dist,  read_cpu};
  Recipe rc;
  rc.source = source;
  rc.name = fs::path(source).stem().string();
  {
    Reader top(&j, "", problems);
    top.string("name", rc.name);
    std::string description;
    top.string("description", description);
    for (const Section read : kSections) read(top, rc, base_dir);
    check_layout(top, rc, base_dir, world_size);
  }
  if (!problems.empty()) throw RecipeError(source, problems);
  rc.resolved = std::move(j);
  return rc;
}

std::vector<std::string> unmatched_overrides(const Recipe& recipe) {
  const auto& overrides = recipe.precision.overrides;
  if (overrides.empty()) return {};
  // Parameter names depend on the layers' kinds, not their sizes.
  auto c = recipe.model;
  c.dim = 2 * c.heads, c.ffn_hidden = 2, c.expert_hidden = 2, c.vocab_size = 2, c.max_seq_len = 2;
  std::vector<std::string> names;
  {
    at::NoGradGuard no_grad;
    for (const auto& p : models::MoETransformer(c)->named_parameters()) names.push_back(p.key());
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < overrides.size(); ++i)
    if (std::none_of(names.begin(), names.end(),
                     [&](const std::string& n) { return fsdp::glob_match(overrides[i].match, n); }))
      out.push_back(fmt::format("precision.overrides[{}].match \"{}\"", i, overrides[i].match));
  return out;
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides,
                   std::optional<int> world_size) {
  json j = read_json_file(path, "recipe");
  return parse_recipe(std::move(j), path, fs::path(path).parent_path().string(), overrides, world_size);
}

}  // namespace fsdpp::train
