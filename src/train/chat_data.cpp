#include "fsdpp/train/chat_data.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/tokenizer.hpp"
#include "text/chat_template.hpp"

namespace fsdpp::train {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

// A config's token: "..." or {"content": "..."}.
std::optional<std::string> token_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return std::nullopt;
}

// Whether the template marks assistant text itself ({% generation %}, {%- generation -%}).
bool has_generation_blocks(const std::string& t) {
  for (size_t at = t.find("{%"); at != std::string::npos; at = t.find("{%", at + 2)) {
    size_t i = at + 2;
    while (i < t.size() && (t[i] == '-' || t[i] == '+' || t[i] == ' ')) ++i;
    if (t.compare(i, 10, "generation") == 0) return true;
  }
  return false;
}

}  // namespace

struct ChatFormat::Impl {
  text::ChatTemplate chat_template;
  ojson special = ojson::object();
  bool generation_blocks;
  explicit Impl(const std::string& source)
      : chat_template(source), generation_blocks(has_generation_blocks(source)) {}
};

ChatFormat::ChatFormat(const Tokenizer& tokenizer, const std::string& override_path) {
  std::string text;
  nlohmann::json config;
  const fs::path dir =
      tokenizer.tokenizer_json().empty() ? fs::path() : fs::path(tokenizer.tokenizer_json()).parent_path();
  const auto config_path = dir / "tokenizer_config.json";
  std::error_code ec;
  if (!dir.empty() && fs::is_regular_file(config_path, ec)) config = read_json_file(config_path.string());
  if (!override_path.empty()) {
    require_regular_file(override_path, "chat template");
    text = read_text_file(override_path);
    source_ = override_path;
  } else if (config.is_object() && config.contains("chat_template")) {
    const auto& t = config["chat_template"];
    if (t.is_string()) {
      text = t.get<std::string>();
    } else if (t.is_array()) {  // named templates: transformers takes "default"
      for (const auto& named : t)
        if (named.is_object() && named.value("name", "") == "default" && named.contains("template"))
          text = named["template"].get<std::string>();
    }
    if (text.empty())
      throw BadInput(fmt::format("{}: chat_template has no default template", config_path.string()));
    source_ = config_path.string();
  } else if (!dir.empty() && fs::is_regular_file(dir / "chat_template.jinja", ec)) {
    source_ = (dir / "chat_template.jinja").string();
    text = read_text_file(source_);
  } else {
    throw BadInput(fmt::format(
        "data.source \"chat\": the tokenizer {} has no chat template ({}), and data.chat_template names none",
        tokenizer.spec(),
        dir.empty()
            ? "only a tokenizer.json's directory holds one"
            : fmt::format("none in {} or {}", config_path.string(), (dir / "chat_template.jinja").string())));
  }
  try {
    impl_ = std::make_unique<Impl>(text);
  } catch (const std::invalid_argument& e) {
    throw BadInput(fmt::format("chat template {}: {}", source_, e.what()));
  }
  for (const char* key :
       {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"})
    if (config.is_object() && config.contains(key))
      if (const auto t = token_text(config[key])) impl_->special[key] = *t;
}

ChatFormat::~ChatFormat() = default;
ChatFormat::ChatFormat(ChatFormat&&) noexcept = default;

std::string ChatFormat::render(const ojson& messages, bool add_generation_prompt,
                               std::vector<std::pair<size_t, size_t>>* assistant) const {
  const auto render_one = [&](const ojson& m, bool gen, std::vector<std::pair<size_t, size_t>>* generated) {
    ojson v = impl_->special;
    v["messages"] = m;
    v["add_generation_prompt"] = gen;
    v["tools"] = nullptr;
    v["documents"] = nullptr;
    return impl_->chat_template.render(v, generated);
  };
  if (!assistant) return render_one(messages, add_generation_prompt, nullptr);
  if (impl_->generation_blocks) return render_one(messages, add_generation_prompt, assistant);
  // Each assistant message's text: what it adds to the conversation before it and its generation
  // prompt. That needs a template that renders a conversation as its prefixes extended.
  assistant->clear();
  const std::string text = render_one(messages, add_generation_prompt, nullptr);
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object() || messages[i].value("role", "") != "assistant") continue;
    const ojson before(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i));
    const ojson upto(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    std::string prompt, turn;
    try {
      prompt = render_one(before, true, nullptr);
      turn = render_one(upto, false, nullptr);
    } catch (const std::runtime_error&) {
      prompt.clear(), turn.clear();
    }
    if (turn.empty() || !turn.starts_with(prompt) || !text.starts_with(turn))
      throw std::runtime_error(
          fmt::format("the chat template does not render messages[{}] (assistant) as an extension of the "
                      "conversation before "
                      "it, so its tokens cannot be found: give the template {{% generation %}} blocks around "
                      "assistant text",
                      i));
    assistant->emplace_back(prompt.size(), turn.size());
  }
  return text;
}

ChatSamples::ChatSamples(std::vector<ChatRow> rows, int64_t seq_len, int32_t pad, uint64_t seed, bool shuffle)
    : rows_(std::move(rows)), seq_len_(seq_len), pad_(pad), seed_(seed), shuffle_(shuffle) {
  if (rows_.empty()) throw std::invalid_argument("ChatSamples: no conversations");
}

const ChatRow& ChatSamples::row_of(int64_t g) const {
  const int64_t n = rows();
  const int64_t epoch = g / n, i = g % n;
  return rows_[size_t(shuffle_ ? permute_index(i, n, seed_ * 0x9E3779B97F4A7C15ULL + uint64_t(epoch)) : i)];
}

std::pair<at::Tensor, at::Tensor> ChatSamples::samples(int64_t first, int64_t count) const {
  const int64_t T = seq_len_;
  auto inputs = at::full({count, T}, pad_, at::kLong), targets = at::full({count, T}, -100, at::kLong);
  auto* in = inputs.data_ptr<int64_t>();
  auto* out = targets.data_ptr<int64_t>();
  for (int64_t s = 0; s < count; ++s) {
    const ChatRow& r = row_of(first + s);
    const int64_t n = static_cast<int64_t>(r.tokens.size());
    for (int64_t t = 0; t < std::min(n, T); ++t) in[s * T + t] = r.tokens[size_t(t)];
    for (int64_t t = 1; t < n && t <= T; ++t)
      if (r.counted[size_t(t)]) out[s * T + t - 1] = r.tokens[size_t(t)];
  }
  return {inputs, targets};
}

int64_t ChatSamples::counted(int64_t first, int64_t count) const {
  int64_t c = 0;
  for (int64_t s = 0; s < count; ++s) {
    const ChatRow& r = row_of(first + s);
    for (size_t t = 1; t < r.counted.size() && int64_t(t) <= seq_len_; ++t) c += r.counted[t];
  }
  return c;
}

namespace {

ojson messages_of(const ojson& line, const std::string& where) {
  const auto as_messages = [&](const ojson& v, const char* key, const char* role) {
    if (v.is_string()) return ojson::array({{{"role", role}, {"content", v}}});
    if (v.is_array()) return v;
    throw BadInput(fmt::format("{}: {}: expected a string or a list of messages", where, key));
  };
  ojson m;
  if (line.is_object() && line.contains("messages")) {
    m = line["messages"];
  } else if (line.is_object() && line.contains("prompt")) {
    m = as_messages(line["prompt"], "prompt", "user");
    if (line.contains("completion"))
      for (const auto& x : as_messages(line["completion"], "completion", "assistant")) m.push_back(x);
  } else {
    throw BadInput(fmt::format(
        "{}: expected {{\"messages\": [...]}} or {{\"prompt\": ..., \"completion\": ...}}", where));
  }
  if (!m.is_array() || m.empty())
    throw BadInput(fmt::format("{}: messages: expected a non-empty list", where));
  for (size_t i = 0; i < m.size(); ++i) {
    if (!m[i].is_object() || !m[i].contains("role") || !m[i]["role"].is_string())
      throw BadInput(
          fmt::format("{}: messages[{}]: expected {{\"role\": a string, \"content\": ...}}", where, i));
    if (m[i].contains("content") && !m[i]["content"].is_string() && !m[i]["content"].is_null())
      throw BadInput(fmt::format("{}: messages[{}].content: expected a string", where, i));
  }
  return m;
}

}  // namespace

std::vector<Conversation> read_conversations(const std::string& path) {
  std::vector<Conversation> out;
  std::ifstream in(path);
  std::string text;
  for (int64_t number = 1; std::getline(in, text); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto where = fmt::format("{}:{}", path, number);
    ojson line;
    try {
      line = ojson::parse(text);
    } catch (const ojson::exception& e) {
      throw BadInput(fmt::format("{}: not JSON: {}", where, e.what()));
    }
    out.push_back({where, messages_of(line, where)});
  }
  return out;
}

ChatData load_chat(const DataOptions& o, const Tokenizer& tokenizer, uint64_t seed) {
  const ChatFormat format(tokenizer, o.chat_template);
  std::vector<Conversation> lines;
  size_t files = 0;
  for (const auto& root : o.paths)
    for (const auto& path : list_text_files(root)) {
      ++files;
      for (auto& c : read_conversations(path)) lines.push_back(std::move(c));
    }
  if (lines.empty()) throw BadInput(fmt::format("data.paths: no conversations in {} file(s)", files));
  const int64_t T = o.seq_len;
  std::vector<ChatRow> train, val;
  int64_t tokens = 0, counted = 0, split_turns = 0;
  uint64_t draw = seed ^ 0xC4A7ULL;
  for (const auto& line : lines) {
    std::vector<std::pair<size_t, size_t>> spans;
    std::string text;
    try {
      text = format.render(line.messages, false, &spans);
    } catch (const std::runtime_error& e) {
      throw BadInput(fmt::format("{}: chat template {}: {}", line.where, format.source(), e.what()));
    }
    // Encoded piece by piece at the assistant turns' edges, so that each token is wholly inside or
    // outside one; where the whole text would tokenize otherwise across an edge, it is counted.
    ChatRow row;
    size_t at = 0;
    const auto add = [&](size_t end, bool assistant) {
      if (end <= at) return;
      for (const auto id : tokenizer.encode(std::string_view(text).substr(at, end - at))) {
        row.tokens.push_back(id);
        row.counted.push_back(assistant);
      }
      at = end;
    };
    for (const auto& [b, e] : spans) add(b, false), add(e, true);
    add(text.size(), false);
    split_turns += row.tokens != tokenizer.encode(text);
    const int64_t n = static_cast<int64_t>(row.tokens.size());
    if (n > T + 1)
      throw BadInput(
          fmt::format("{}: the conversation is {} tokens, longer than data.seq_len + 1 = {} (a sample holds "
                      "one conversation): shorten it or raise data.seq_len",
                      line.where, n, T + 1));
    int64_t c = 0;
    for (int64_t t = 1; t < n; ++t) c += row.counted[size_t(t)];
    if (c == 0)
      throw BadInput(
          fmt::format("{}: no assistant tokens: nothing in this conversation is trained on", line.where));
    tokens += n, counted += c;
    (uniform01(draw) < o.val_fraction ? val : train).push_back(std::move(row));
  }
  if (val.empty() && train.size() > 1) val.push_back(train.back()), train.pop_back();
  if (val.empty()) val = train;
  const int32_t pad = tokenizer.eot() >= 0 ? tokenizer.eot() : 0;
  ChatData d;
  d.description = fmt::format(
      "chat: {} conversations from {} file(s) ({} held out), {} tokens, {:.0f}% of them assistant targets; "
      "template {}{}",
      lines.size(), files, val.size(), tokens, 100.0 * double(counted) / double(std::max<int64_t>(1, tokens)),
      format.source(),
      split_turns ? fmt::format("; {} tokenized apart at turn edges where the whole text tokenizes otherwise",
                                split_turns)
                  : "");
  d.train = std::make_shared<ChatSamples>(std::move(train), T, pad, seed, true);
  d.val = std::make_shared<ChatSamples>(std::move(val), T, pad, 0, false);
  return d;
}

}  // namespace fsdpp::train
