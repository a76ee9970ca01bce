#pragma once
// The recipe parser's internals, shared by recipe.cpp (the whole recipe) and recipe_sections.cpp
// (one reader per section): a Reader walks one JSON object, recording the keys it knows, and every
// problem goes to one list, so that one pass reports everything.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <optional>
#include <vector>

#include "fsdpp/train/recipe.hpp"

namespace fsdpp::train::recipe_detail {

using nlohmann::json;

inline bool has_suffix(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

inline std::string type_name(const json& v) {
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
  // A reader of an array's element `j`, named `key` ("overrides[0]"), with hints of its own.
  Reader element(const json* j, const std::string& key) { return Reader(j, at(key), problems_); }

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
      return fail(key, fmt::format("must be one of {}, got \"{}\"{}", fmt::join(choices, " | "), s,
                                   suggest(s, choices)));
    out = s;
  }
  // One of a few names, as the enum value the table pairs it with.
  template <class E>
  void choice(const std::string& key, E& out, std::initializer_list<E> values) {
    std::vector<std::string> names;
    for (const E v : values) names.push_back(name_of(v));
    std::string s = name_of(out);
    string(key, s, names);
    for (const E v : values)
      if (s == name_of(v)) out = v;
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

  void integers(const std::string& key, std::vector<int64_t>& out, int64_t lo, int64_t hi) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_array()) return fail(key, fmt::format("must be an array of integers, got {}", type_name(*v)));
    std::vector<int64_t> got;
    for (size_t i = 0; i < v->size(); ++i) {
      const auto& x = (*v)[i];
      if (!x.is_number_integer() || (x.is_number_unsigned() && x.get<uint64_t>() > uint64_t(hi)) ||
          x.get<int64_t>() < lo || x.get<int64_t>() > hi)
        return fail(fmt::format("{}[{}]", key, i), fmt::format("must be an integer in [{}, {}]", lo, hi));
      got.push_back(x.get<int64_t>());
    }
    out = std::move(got);
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

inline constexpr int64_t kBig = int64_t(1) << 40;
inline const std::vector<std::string> kDtypes = {"float32", "bfloat16", "float16"};

// One of kDtypes (the Reader has checked the name; anything else is a bug here, not a fallback).
inline at::ScalarType dtype_named(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::logic_error("recipe: no dtype named '" + name + "'");
}

// A path given in a recipe: absolute, or relative to `base_dir` where it exists there, else to the
// working directory.
std::string resolve(const std::string& p, const std::string& base_dir);
// A JSON file of a recipe's (`what`: "recipe", "model config"): RecipeError for a missing, large,
// malformed file or a key given twice.
json read_json_file(const std::string& path, const std::string& what);

// What each section reads, in order (recipe_sections.cpp). `top` is the recipe's own reader, for
// rules that name keys of several sections.
void read_model_section(Reader& top, Recipe& rc, const std::string& base_dir);
void read_data(Reader& top, Recipe& rc, const std::string& base_dir);
void read_parallel(Reader& top, Recipe& rc, const std::string& base_dir);
void read_precision(Reader& top, Recipe& rc, const std::string& base_dir);
void read_optim(Reader& top, Recipe& rc, const std::string& base_dir);
void read_train(Reader& top, Recipe& rc, const std::string& base_dir);
void read_eval(Reader& top, Recipe& rc, const std::string& base_dir);
void read_checkpoint(Reader& top, Recipe& rc, const std::string& base_dir);
void read_logging(Reader& top, Recipe& rc, const std::string& base_dir);
void read_dist(Reader& top, Recipe& rc, const std::string& base_dir);
void read_cpu(Reader& top, Recipe& rc, const std::string& base_dir);
// The rules that tie sections together (layout, batch, schedule), after every section is read.
void check_layout(Reader& top, Recipe& rc, const std::string& base_dir, std::optional<int> world_size);
// A model config's keys (also for `fsdpp ls` and parse_model_config).
void read_model(Reader& r, models::MoEConfig& c);

}  // namespace fsdpp::train::recipe_detail
