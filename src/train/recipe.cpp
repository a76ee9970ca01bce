#include "fsdpp/train/recipe.hpp"

#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "fsdpp/comm/init.hpp"
#include "fsdpp/models/moe.hpp"
#include "fsdpp/pipeline/plan.hpp"
#include "fsdpp/pipeline/table.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/shards.hpp"
#include "fsdpp/train/tokenizer.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string join_lines(const std::string& source, const std::vector<std::string>& problems) {
  std::string s = fmt::format("{}: {} problem{}", source, problems.size(), problems.size() == 1 ? "" : "s");
  for (const auto& p : problems) s += "\n  " + p;
  return s;
}

// (std::string::ends_with is C++20; this file also builds as C++17 for the fuzzer.)
bool has_suffix(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string type_name(const json& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

// Walks one JSON object, recording the keys it knows; problems go to a shared list, so one pass
// reports everything.
class Reader {
 public:
  Reader(const json* j, std::string path, std::vector<std::string>& problems,
         std::shared_ptr<std::set<std::string>> all_paths = std::make_shared<std::set<std::string>>())
      : value_(j), path_(std::move(path)), problems_(problems), all_paths_(std::move(all_paths)) {
    if (value_ && !value_->is_object()) {
      fail("", fmt::format("must be an object, got {}", type_name(*value_)));
      value_ = nullptr;
    }
  }
  ~Reader() { unknown_keys(); }

  std::string at(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  // One problem per key: a later check of a key whose value was refused would test the default it
  // kept, and name a value the user never gave.
  void fail(const std::string& key, const std::string& what) {
    const std::string where = key.empty() ? path_ : at(key);
    for (const auto& p : problems_)
      if (p.rfind(where + ": ", 0) == 0) return;
    problems_.push_back(fmt::format("{}: {}", where, what));
  }
  const json* find(const std::string& key) {
    known_.insert(key);
    all_paths_->insert(at(key));
    if (!value_) return nullptr;
    auto it = value_->find(key);
    return it == value_->end() ? nullptr : &*it;
  }
  Reader section(const std::string& key) { return Reader(find(key), at(key), problems_, all_paths_); }

  template <class Int>
  void integer(const std::string& key, Int& out, int64_t lo, int64_t hi) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_number_integer()) return fail(key, fmt::format("must be an integer, got {}", type_name(*v)));
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
      return fail(key, fmt::format("must be in [{}, {}], got {}", lo, hi, v->get<uint64_t>()));
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) return fail(key, fmt::format("must be in [{}, {}], got {}", lo, hi, x));
    out = static_cast<Int>(x);
  }
  // (lo, hi] when lo_open, else [lo, hi].
  void number(const std::string& key, double& out, double lo, double hi, bool lo_open = false) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_number()) return fail(key, fmt::format("must be a number, got {}", type_name(*v)));
    const double x = v->get<double>();
    if ((lo_open ? x <= lo : x < lo) || x > hi)
      return fail(key, fmt::format("must be in {}{}, {}], got {}", lo_open ? "(" : "[", lo, hi, x));
    out = x;
  }
  void boolean(const std::string& key, bool& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_boolean()) return fail(key, fmt::format("must be true or false, got {}", type_name(*v)));
    out = v->get<bool>();
  }
  void string(const std::string& key, std::string& out, const std::vector<std::string>& choices = {}) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_string()) return fail(key, fmt::format("must be a string, got {}", type_name(*v)));
    const auto s = v->get<std::string>();
    if (!choices.empty() && std::find(choices.begin(), choices.end(), s) == choices.end())
      return fail(key, fmt::format("must be one of {}, got \"{}\"{}", fmt::join(choices, " | "), s, suggest(s, choices)));
    out = s;
  }
  void strings(const std::string& key, std::vector<std::string>& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_array()) return fail(key, fmt::format("must be an array of strings, got {}", type_name(*v)));
    out.clear();
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string()) return fail(fmt::format("{}[{}]", key, i), "must be a string");
      out.push_back((*v)[i].get<std::string>());
    }
  }

  static std::string suggest(const std::string& s, const std::vector<std::string>& options) {
    // In half edits: a prefix either way ("drop" -> "dropless") counts as one and a half.
    std::string best;
    size_t best_d = 2 * (std::max<size_t>(2, s.size() / 3) + 1);
    for (const auto& o : options) {
      const bool prefix = !s.empty() && (o.rfind(s, 0) == 0 || s.rfind(o, 0) == 0);
      const size_t d = std::min(2 * edit_distance(s, o), prefix ? size_t(3) : SIZE_MAX);
      if (d < best_d) best_d = d, best = o;
    }
    return best.empty() ? "" : fmt::format(", did you mean '{}'?", best);
  }

 private:
  void unknown_keys() {
    if (!value_) return;
    const std::vector<std::string> known(known_.begin(), known_.end());
    for (const auto& [k, v] : value_->items()) {
      if (known_.count(k)) continue;
      std::string hint = suggest(k, known);
      if (hint.empty())  // a key of another section?
        for (const auto& p : *all_paths_)
          if (p.size() > k.size() && has_suffix(p, "." + k) && p.rfind(path_, 0) == 0) {
            hint = fmt::format(", did you mean '{}'?", p);
            break;
          }
      fail(k, "unknown key" + hint);
    }
  }

  const json* value_;
  std::string path_;
  std::vector<std::string>& problems_;
  std::shared_ptr<std::set<std::string>> all_paths_;  // every path read so far, for hints
  std::set<std::string> known_;
};

constexpr int64_t kBig = int64_t(1) << 40;
const std::vector<std::string> kDtypes = {"float32", "bfloat16", "float16"};

// One of kDtypes (the Reader has checked the name; anything else is a bug here, not a fallback).
at::ScalarType dtype_named(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::logic_error("recipe: no dtype named '" + name + "'");
}

fsdp::MixedPrecisionPolicy precision_policy(const PrecisionOptions& p) {
  fsdp::MixedPrecisionPolicy policy;
  if (p.param_dtype != at::kFloat) policy.param_dtype = p.param_dtype;  // float32: keep each parameter's own
  policy.reduce_dtype = p.reduce_dtype;
  if (p.overrides.empty()) return policy;
  auto pick = [overrides = p.overrides](bool grad) -> fsdp::DtypeFn {
    return [overrides, grad](const std::string& name, const at::Tensor&) -> std::optional<at::ScalarType> {
      for (const auto& o : overrides) {
        const auto& dtype = grad ? o.grad_dtype : o.param_dtype;
        if (dtype && fsdp::glob_match(o.match, name)) return dtype;
      }
      return std::nullopt;
    };
  };
  policy.param_dtype_override = pick(false);
  policy.grad_dtype = pick(true);
  return policy;
}

void read_model(Reader& r, models::MoEConfig& c) {
  r.integer("vocab_size", c.vocab_size, 2, 1 << 20);
  r.integer("dim", c.dim, 2, 1 << 16);
  r.integer("layers", c.layers, 1, 1024);
  r.integer("heads", c.heads, 1, 1024);
  r.integer("max_seq_len", c.max_seq_len, 1, 1 << 20);
  r.integer("ffn_hidden", c.ffn_hidden, 1, 1 << 20);
  r.integer("dense_layers", c.dense_layers, 0, 1024);
  r.integer("experts", c.experts, 0, 4096);
  r.integer("top_k", c.top_k, 1, 4096);
  r.integer("expert_hidden", c.expert_hidden, 1, 1 << 20);
  r.boolean("shared_expert", c.shared_expert);
  r.string("score", c.score, {"softmax", "sigmoid"});
  r.boolean("normalize_top_k", c.normalize_top_k);
  r.string("routing", c.routing, {"dropless", "capacity"});
  r.number("capacity_factor", c.capacity_factor, 0, 1e6, /*lo_open=*/true);
  r.number("aux_loss_coef", c.aux_loss_coef, 0, 1e6);
  r.number("z_loss_coef", c.z_loss_coef, 0, 1e6);
  r.number("rope_theta", c.rope_theta, 0, 1e12, true);
  r.number("norm_eps", c.norm_eps, 0, 1, true);
  r.number("init_std", c.init_std, 0, 10, true);
  r.boolean("fused_kernels", c.fused_kernels);
  r.boolean("fused_attention", c.fused_attention);
  r.boolean("onednn_matmul", c.onednn_matmul);
  if (c.dim % c.heads != 0 || (c.dim / c.heads) % 2 != 0)
    r.fail("heads", fmt::format("dim {} must split into {} heads of even size (rotary embeddings rotate pairs)", c.dim, c.heads));
  if (c.experts > 0 && c.top_k > c.experts)
    r.fail("top_k", fmt::format("must be at most experts ({}), got {}", c.experts, c.top_k));
  if (c.dense_layers > c.layers)
    r.fail("dense_layers", fmt::format("must be at most layers ({}), got {}", c.layers, c.dense_layers));
}

std::string resolve(const std::string& p, const std::string& base_dir) {
  if (fs::path(p).is_absolute()) return p;
  const auto rel = fs::path(base_dir) / p;
  std::error_code ec;  // (a name too long for the file system is simply not there)
  if (fs::exists(rel, ec)) return rel.lexically_normal().string();
  return p;  // relative to the working directory
}

json read_json_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw RecipeError(path, {fmt::format("cannot read this {} file: {}", what, fs::exists(path, ec) ? "not a regular file" : "no such file")});
  if (fs::file_size(path, ec) > (64u << 20)) throw RecipeError(path, {fmt::format("this {} file is over 64 MiB", what)});
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
    throw RecipeError(path, {fmt::format("{}: given twice in this {} file (JSON would keep only the last)", repeated, what)});
  return j;
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

// Whether the plan splits some backward into input and weight halves (I, W), as the zero-bubble
// schedules do.
bool splits_backward(const pipeline::Plan& plan) {
  for (const auto& rank : plan.compute)
    for (const auto& a : rank)
      if (a.type == pipeline::ActionType::kBackwardInput) return true;
  return false;
}

}  // namespace

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
  return train.global_batch / (parallel.dp * train.grad_accum * (parallel.pp > 1 ? parallel.microbatches : 1));
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
  return {{"vocab_size", c.vocab_size}, {"dim", c.dim}, {"layers", c.layers}, {"heads", c.heads},
          {"max_seq_len", c.max_seq_len}, {"ffn_hidden", c.ffn_hidden}, {"dense_layers", c.dense_layers},
          {"experts", c.experts}, {"top_k", c.top_k}, {"expert_hidden", c.expert_hidden},
          {"shared_expert", c.shared_expert}, {"score", c.score}, {"normalize_top_k", c.normalize_top_k},
          {"routing", c.routing}, {"capacity_factor", c.capacity_factor}, {"aux_loss_coef", c.aux_loss_coef},
          {"z_loss_coef", c.z_loss_coef}, {"rope_theta", c.rope_theta}, {"norm_eps", c.norm_eps},
          {"init_std", c.init_std}};
}

Recipe parse_recipe(json j, const std::string& source, const std::string& base_dir,
                    const std::vector<std::string>& overrides, std::optional<int> world_size) {
  std::vector<std::string> problems;
  if (!j.is_object()) throw RecipeError(source, {fmt::format("a recipe is a JSON object, got {}", type_name(j))});
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

  Recipe rc;
  rc.source = source;
  rc.name = fs::path(source).stem().string();
  {
    Reader top(&j, "", problems);
    top.string("name", rc.name);
    std::string description;
    top.string("description", description);
    if (!j.contains("model")) top.fail("model", "missing: a model config path or object");
    {
      Reader m = top.section("model");
      read_model(m, rc.model);
      m.string("init_from", rc.init_from);
      if (!rc.init_from.empty()) {
        rc.init_from = resolve(rc.init_from, base_dir);
        std::error_code ec;
        if (!fs::is_regular_file(rc.init_from, ec))
          m.fail("init_from", fmt::format("{} is not a file (a safetensors file of full weights)", rc.init_from));
      }
    }
    {
      Reader d = top.section("data");
      d.string("source", rc.data.source, {"fortunes", "files", "synthetic", "shards"});
      d.strings("paths", rc.data.paths);
      d.string("path", rc.data.path);
      d.string("tokenizer", rc.data.tokenizer);
      d.integer("seq_len", rc.data.seq_len, 2, 1 << 20);
      d.number("val_fraction", rc.data.val_fraction, 0, 0.5, true);
      d.integer("synthetic_bytes", rc.data.synthetic_bytes, 1024, kBig);
      if (rc.data.seq_len > rc.model.max_seq_len)
        d.fail("seq_len", fmt::format("must be at most model.max_seq_len ({}), got {}", rc.model.max_seq_len, rc.data.seq_len));
      if (rc.data.source == "files" && rc.data.paths.empty()) d.fail("paths", "source \"files\" needs at least one path");
      if (rc.data.source != "files" && !rc.data.paths.empty())
        d.fail("paths", fmt::format("only read with source \"files\" (source is \"{}\")", rc.data.source));
      if (rc.data.source == "shards" && rc.data.path.empty())
        d.fail("path", "source \"shards\" needs the directory of token shards (fsdpp tokenize writes one)");
      if (rc.data.source != "shards" && !rc.data.path.empty())
        d.fail("path", fmt::format("only read with source \"shards\" (source is \"{}\")", rc.data.source));
      if (!rc.data.path.empty()) {
        rc.data.path = resolve(rc.data.path, base_dir);
        std::error_code ec;
        if (!fs::is_directory(rc.data.path, ec)) {
          d.fail("path", fmt::format("{} is not a directory", rc.data.path));
        } else {
          // Every shard's header against its size (and the index), before any rank starts.
          for (const char* split : {"train", "val"}) try {
              ShardSet(rc.data.path, split, rc.model.vocab_size);
            } catch (const std::exception& e) {
              d.fail("path", e.what());
            }
        }
      }
      // "none": token shards made by another tool (llm.c's GPT-2 files): tokens are only checked
      // against the model's vocabulary, and nothing is decoded.
      if (rc.data.tokenizer == "none" && rc.data.source != "shards")
        d.fail("tokenizer", fmt::format("\"none\" is only for source \"shards\" (source is \"{}\")", rc.data.source));
      if (rc.data.tokenizer != "bytes" && rc.data.tokenizer != "none") rc.data.tokenizer = resolve(rc.data.tokenizer, base_dir);
      if (rc.data.tokenizer != "none") try {
        rc.tokenizer = Tokenizer::load(rc.data.tokenizer);
        if (rc.tokenizer->vocab_size() != rc.model.vocab_size)
          d.fail("tokenizer", fmt::format("{} has a vocabulary of {} but model.vocab_size is {}: they must be equal",
                                          rc.data.tokenizer, rc.tokenizer->vocab_size(), rc.model.vocab_size));
        const auto index = fs::path(rc.data.path) / "index.json";
        std::error_code ec;
        if (rc.data.source == "shards" && fs::is_regular_file(index, ec)) {
          const auto recorded = read_json_file(index.string(), "shard index").value("tokenizer", json::object());
          try {
            rc.tokenizer->check_matches(recorded, "data.path " + rc.data.path);
          } catch (const std::runtime_error& e) {
            d.fail("tokenizer", fmt::format("{}: set data.tokenizer to the tokenizer the shards were made with", e.what()));
          }
        }
      } catch (const std::exception& e) {
        d.fail("tokenizer", e.what());
      }
      for (size_t i = 0; i < rc.data.paths.size(); ++i) {
        auto& p = rc.data.paths[i];
        p = resolve(p, base_dir);
        // Text files and directories of them: a FIFO would block, a device never end.
        if (const auto kind = file_kind(p); kind == "missing")
          d.fail(fmt::format("paths[{}]", i), fmt::format("{} does not exist", p));
        else if (kind != "a regular file" && kind != "a directory")
          d.fail(fmt::format("paths[{}]", i), fmt::format("{} is {}, not a text file or a directory of them", p, kind));
      }
    }
    {
      Reader p = top.section("parallel");
      p.integer("dp", rc.parallel.dp, 1, 4096);
      p.integer("pp", rc.parallel.pp, 1, 1024);
      p.string("schedule", rc.parallel.schedule);
      p.integer("microbatches", rc.parallel.microbatches, 1, 1 << 16);
      const bool stages_given = p.find("stages_per_rank") != nullptr;
      p.integer("stages_per_rank", rc.parallel.stages_per_rank, 1, 64);
      // A V schedule holds two stages per rank: that is its default.
      if (!stages_given && rc.parallel.pp > 1 && !pipeline::is_table_file(rc.parallel.schedule)) {
        const auto names = pipeline::schedule_names();
        if (std::find(names.begin(), names.end(), rc.parallel.schedule) != names.end() &&
            pipeline::make_schedule(rc.parallel.schedule)->layout() == pipeline::Layout::kV)
          rc.parallel.stages_per_rank = 2;
      }
      p.integer("max_outstanding_sends", rc.parallel.max_outstanding_sends, 0, 1 << 16);
      p.boolean("keep_stages_unsharded", rc.parallel.keep_stages_unsharded);
      p.integer("unshard_window", rc.parallel.unshard_window, 1, 64);
      p.boolean("reshard_after_forward", rc.parallel.reshard_after_forward);
      p.integer("microbatch_threads", rc.parallel.microbatch_threads, 1, 64);
      int dp_shard = 0;
      p.integer("ep", rc.parallel.ep, 1, 4096);
      p.integer("dp_replicate", rc.parallel.dp_replicate, 1, 4096);
      p.integer("dp_shard", dp_shard, 1, 4096);
      // dp_shard, when given, sets dp (so that an override of it needs no matching override of dp).
      auto& par = rc.parallel;
      if (dp_shard > 0) par.dp = par.dp_replicate * dp_shard;
      if (par.dp % par.dp_replicate != 0)
        p.fail("dp_replicate", fmt::format("must divide parallel.dp ({}), got {}", par.dp, par.dp_replicate));
    }
    {
      Reader pr = top.section("precision");
      std::string param_dtype = "float32", reduce_dtype = "float32";
      pr.string("param_dtype", param_dtype, kDtypes);
      pr.string("reduce_dtype", reduce_dtype, kDtypes);
      rc.precision.param_dtype = dtype_named(param_dtype);
      rc.precision.reduce_dtype = dtype_named(reduce_dtype);
      if (const json* ov = pr.find("overrides")) {
        if (!ov->is_array()) {
          pr.fail("overrides", "must be an array of {\"match\": ..., \"param_dtype\": ..., \"grad_dtype\": ...}");
        } else {
          for (size_t i = 0; i < ov->size(); ++i) {
            Reader o(&(*ov)[i], pr.at(fmt::format("overrides[{}]", i)), problems);  // own hints
            DtypeOverride d;
            o.string("match", d.match);
            std::string pd, gd;
            o.string("param_dtype", pd, kDtypes);
            o.string("grad_dtype", gd, kDtypes);
            if (d.match.empty()) o.fail("match", "missing: a glob on parameter names, for example \"*norm*\"");
            if (!o.find("param_dtype") && !o.find("grad_dtype")) o.fail("", "needs param_dtype or grad_dtype");
            if (!pd.empty()) d.param_dtype = dtype_named(pd);
            if (!gd.empty()) d.grad_dtype = dtype_named(gd);
            rc.precision.overrides.push_back(d);
          }
        }
      }
      rc.precision.policy = precision_policy(rc.precision);
    }
    {
      Reader o = top.section("optim");
      o.number("lr", rc.optim.lr, 0, 10, true);
      o.number("min_lr_ratio", rc.optim.min_lr_ratio, 0, 1);
      o.number("weight_decay", rc.optim.weight_decay, 0, 10);
      o.number("beta1", rc.optim.beta1, 0, 0.999999);
      o.number("beta2", rc.optim.beta2, 0, 0.999999);
      o.number("eps", rc.optim.eps, 0, 1, true);
      o.integer("warmup_steps", rc.optim.warmup_steps, 0, kBig);
      o.number("grad_clip", rc.optim.grad_clip, 0, 1e9);
    }
    {
      Reader t = top.section("train");
      t.integer("steps", rc.train.steps, 1, kBig);
      t.integer("global_batch", rc.train.global_batch, 1, kBig);
      t.integer("grad_accum", rc.train.grad_accum, 1, 1 << 20);
      t.integer("seed", rc.train.seed, 0, kBig);
      t.string("device", rc.train.device, {"cpu", "cuda"});
      t.boolean("cuda_graph", rc.train.cuda_graph);
      if (const json* ac = t.find("activation_checkpointing")) {
        if (ac->is_string() && (*ac == "none" || *ac == "full")) {
          rc.train.activation_checkpointing = *ac == "full" ? 1 : 0;
        } else if (ac->is_number_integer() && *ac >= 1 && *ac <= rc.model.layers) {
          rc.train.activation_checkpointing = ac->get<int64_t>();
        } else {
          t.fail("activation_checkpointing",
                 fmt::format("must be \"none\", \"full\" or k, every k-th block (1 to model.layers = {}), got {}",
                             rc.model.layers, ac->dump()));
        }
      }
      if (rc.train.device == "cuda" && !comm::has_backend(comm::Backend::kNccl))
        t.fail("device", "\"cuda\" needs fsdpp built with the NCCL backend (a CUDA build of LibTorch; this build "
                         "has none)");
      if (rc.train.cuda_graph && rc.train.device != "cuda") t.fail("cuda_graph", "needs train.device \"cuda\"");
      if (rc.train.cuda_graph && rc.model.routing != "capacity")
        t.fail("cuda_graph", fmt::format("needs model.routing \"capacity\" (static shapes; \"{}\" routing reads each "
                                         "expert's token count on the host, which a graph cannot replay)",
                                         rc.model.routing));
    }
    {
      Reader e = top.section("eval");
      e.integer("interval", rc.eval.interval, 0, kBig);
      e.integer("batches", rc.eval.batches, 1, 1 << 20);
    }
    {
      Reader c = top.section("checkpoint");
      c.boolean("enabled", rc.checkpoint.enabled);
      c.integer("interval", rc.checkpoint.interval, 0, kBig);
      c.integer("keep", rc.checkpoint.keep, 1, 1 << 20);
      c.string("storage", rc.checkpoint.storage, {"shared", "local"});
    }
    {
      Reader l = top.section("logging");
      l.integer("interval", rc.logging.interval, 1, kBig);
      l.string("metrics", rc.logging.metrics, {"rank0", "all", "none"});
      l.boolean("plot", rc.logging.plot);
      l.string("output_dir", rc.logging.output_dir);
      if (rc.logging.output_dir.empty()) l.fail("output_dir", "must not be empty");
    }

    {
      Reader d = top.section("dist");
      d.number("watchdog_timeout_s", rc.dist.watchdog_timeout_s, 0, 1e7);
      d.boolean("check_collectives", rc.dist.check_collectives);
      d.string("cpu_binding", rc.dist.cpu_binding, {"none", "rank", "compute"});
      d.integer("compute_nice", rc.dist.compute_nice, 0, 19);
      d.string("compute_policy", rc.dist.compute_policy, {"normal", "idle"});
      if (rc.dist.compute_policy == "idle" && rc.dist.compute_nice != 0)
        d.fail("compute_nice", fmt::format("{} has no effect with dist.compute_policy \"idle\" (a SCHED_IDLE thread has "
                                           "no nice value): set dist.compute_nice=0 or dist.compute_policy=normal",
                                           rc.dist.compute_nice));
      d.integer("cpu_rotation_ms", rc.dist.cpu_rotation_ms, 0, 60000);
      if (rc.dist.cpu_rotation_ms > 0 && rc.dist.cpu_binding == "none")
        d.fail("cpu_rotation_ms", fmt::format("{} moves the computing threads between the CPU shares that dist.cpu_binding "
                                              "makes, but dist.cpu_binding is \"none\": bind (\"compute\" or \"rank\") "
                                              "or set dist.cpu_rotation_ms=0",
                                              rc.dist.cpu_rotation_ms));
      d.boolean("keep_freed_memory", rc.dist.keep_freed_memory);
    }

    // Layout: the rules that tie sections together.
    const auto& par = rc.parallel;
    if (world_size && *world_size != par.dp * par.pp)
      top.fail("parallel", fmt::format("dp x pp = {} x {} = {} ranks, but the world has {}", par.dp, par.pp,
                                       par.dp * par.pp, *world_size));
    const int64_t per_step = int64_t(par.dp) * rc.train.grad_accum * (par.pp > 1 ? par.microbatches : 1);
    if (rc.train.global_batch % per_step != 0)
      top.fail("train.global_batch",
               fmt::format("must be a multiple of dp x grad_accum{} = {}, got {}",
                           par.pp > 1 ? " x parallel.microbatches" : "", per_step, rc.train.global_batch));
    if (par.pp == 1 && par.microbatches != 1)
      top.fail("parallel.microbatches", "only used with pp > 1 (use train.grad_accum to split the batch)");
    if (par.pp == 1 && par.stages_per_rank != 1)
      top.fail("parallel.stages_per_rank", "only used with pp > 1");
    if (par.pp > 1) {
      const int stages = par.pp * par.stages_per_rank;
      if (stages > rc.model.layers)
        top.fail("parallel", fmt::format("pp x stages_per_rank = {} stages, but the model has {} layers", stages,
                                         rc.model.layers));
      try {
        // Checked here first for messages that say more than the loaders' (a suggestion, a path).
        const auto& s = par.schedule;
        if (pipeline::is_table_file(s)) {
          rc.parallel.schedule = resolve(s, base_dir);
          std::error_code ec;
          if (!fs::is_regular_file(rc.parallel.schedule, ec))
            throw pipeline::ScheduleError(fmt::format("{}: no such schedule file", rc.parallel.schedule));
        } else {
          const auto names = pipeline::schedule_names();
          if (std::find(names.begin(), names.end(), s) == names.end())
            throw pipeline::ScheduleError(fmt::format("unknown schedule \"{}\" (known: {}){}", s, fmt::join(names, ", "),
                                                      Reader::suggest(s, names)));
        }
        rc.plan = std::make_shared<const pipeline::Plan>(
            pipeline::make_plan(*pipeline::schedule_from(rc.parallel.schedule),
                                {.pp = par.pp, .stages_per_rank = par.stages_per_rank, .microbatches = par.microbatches},
                                {.fsdp_stages = true, .max_outstanding_sends = par.max_outstanding_sends,
                                 .unshard_window = par.unshard_window}));
      } catch (const std::exception& e) {
        top.fail("parallel.schedule", e.what());
      }
      if (rc.plan && rc.train.activation_checkpointing > 0 && splits_backward(*rc.plan))
        top.fail("train.activation_checkpointing",
                 fmt::format("schedule {} splits backward into input and weight halves (I, W), which would "
                             "recompute each checkpointed block twice and count its weight gradients twice; "
                             "use a schedule without I/W or \"none\"", par.schedule));
    } else if (par.max_outstanding_sends != 0) {
      top.fail("parallel.max_outstanding_sends", "only used with pp > 1");
    }
    if (par.ep > 1) {
      if (rc.model.experts == 0)
        top.fail("parallel.ep", "expert parallelism needs MoE layers; model.experts is 0");
      else if (rc.model.experts % par.ep != 0)
        top.fail("parallel.ep", fmt::format("must divide model.experts ({}), got {}", rc.model.experts, par.ep));
      if (par.dp_shard() % par.ep != 0)
        top.fail("parallel.ep", fmt::format("must divide the shard group (parallel.dp / parallel.dp_replicate = {}), "
                                            "got {}: expert-parallel ranks are data-parallel ranks",
                                            par.dp_shard(), par.ep));
      if (rc.plan && splits_backward(*rc.plan))
        top.fail("parallel.ep", fmt::format("schedule {} splits backward into input and weight halves (I, W); "
                                            "expert parallelism exchanges tokens inside one whole backward: "
                                            "use a schedule without I/W", par.schedule));
    }
    if (par.pp == 1 && !par.keep_stages_unsharded) top.fail("parallel.keep_stages_unsharded", "only used with pp > 1");
    if (par.pp == 1 && par.unshard_window != ParallelOptions{}.unshard_window) top.fail("parallel.unshard_window", "only used with pp > 1");
    if (par.pp > 1 && !par.reshard_after_forward && !par.keep_stages_unsharded)
      top.fail("parallel.reshard_after_forward", "false keeps blocks gathered through the step, which contradicts "
                                                 "parallel.keep_stages_unsharded: false");
    if (par.microbatch_threads > 1) {
      const int n = par.microbatch_threads;
      if (par.pp > 1)
        top.fail("parallel.microbatch_threads", "only used with pp = 1: a pipeline's microbatches follow its schedule");
      else if (rc.train.grad_accum % n != 0)
        top.fail("parallel.microbatch_threads",
                 fmt::format("must divide train.grad_accum ({}), the step's microbatches, got {}", rc.train.grad_accum, n));
      if (par.ep > 1)
        top.fail("parallel.microbatch_threads", "not with expert parallelism (parallel.ep > 1), whose token exchanges "
                                                "are collectives inside each microbatch's forward and backward");
      if (rc.train.device != "cpu")
        top.fail("parallel.microbatch_threads",
                 fmt::format("runs microbatches on CPU threads; train.device is \"{}\"", rc.train.device));
    }
    if (par.dp_replicate > 1 && rc.checkpoint.storage == "local")
      top.fail("parallel.dp_replicate", "HSDP writes one copy of each shard, from the first replica group; with "
                                        "checkpoint.storage \"local\" the other nodes could not resume: use \"shared\"");
    std::error_code ec;
    if (rc.data.source == "fortunes" && !fs::is_directory(fortunes_dir(), ec))
      top.fail("data.source", fmt::format("the fortunes corpus is not at {} (install Debian's fortunes package: "
                                          "bash scripts/setup.sh)", fortunes_dir()));
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
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return fsdp::glob_match(overrides[i].match, n); }))
      out.push_back(fmt::format("precision.overrides[{}].match \"{}\"", i, overrides[i].match));
  return out;
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides, std::optional<int> world_size) {
  json j = read_json_file(path, "recipe");
  return parse_recipe(std::move(j), path, fs::path(path).parent_path().string(), overrides, world_size);
}

}  // namespace fsdpp::train
