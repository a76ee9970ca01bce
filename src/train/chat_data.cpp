#include "fsdpp/train/chat_data.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <stdexcept>

#include "fsdpp/base/files.hpp"
#include "fsdpp/base/paths.hpp"
#include "fsdpp/train/data.hpp"
#include "fsdpp/train/recipe.hpp"
#include "fsdpp/train/shards.hpp"
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

ChatSamples::ChatSamples(std::vector<ChatRow> rows, int64_t seq_len, int32_t pad, uint64_t seed, bool shuffle,
                         bool pack)
    : rows_(std::move(rows)), pack_(pack), seq_len_(seq_len), pad_(pad), seed_(seed), shuffle_(shuffle) {
  if (rows_.empty()) throw std::invalid_argument("ChatSamples: no conversations");
  if (!pack) {
    for (uint32_t i = 0; i < rows_.size(); ++i) samples_.push_back({i});
    return;
  }
  // Best fit decreasing: longest row first (the earlier among equals), each into the sample with the
  // least room that holds it, a new sample when none does.
  std::vector<uint32_t> order(rows_.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return rows_[a].tokens.size() > rows_[b].tokens.size(); });
  std::multimap<int64_t, size_t> room;  // room left -> sample
  for (const uint32_t r : order) {
    const auto n = static_cast<int64_t>(rows_[r].tokens.size());
    auto it = room.lower_bound(n);
    size_t s;
    int64_t left;
    if (it == room.end()) {
      s = samples_.size(), left = seq_len + 1;
      samples_.emplace_back();
    } else {
      s = it->second, left = it->first;
      room.erase(it);
    }
    samples_[s].push_back(r);
    if (left - n > 0) room.emplace(left - n, s);
  }
}

double ChatSamples::fill() const {
  double tokens = 0;
  for (const auto& r : rows_) tokens += double(r.tokens.size());
  return tokens / (double(samples_.size()) * double(seq_len_ + 1));
}

const std::vector<uint32_t>& ChatSamples::sample_of(int64_t g) const {
  const int64_t n = size();
  const int64_t epoch = g / n, i = g % n;
  return samples_[size_t(shuffle_ ? permute_index(i, n, seed_ * 0x9E3779B97F4A7C15ULL + uint64_t(epoch))
                                  : i)];
}

ChatBatch ChatSamples::samples(int64_t first, int64_t count) const {
  const int64_t T = seq_len_;
  ChatBatch batch{at::full({count, T}, pad_, at::kLong), at::full({count, T}, -100, at::kLong), at::Tensor()};
  auto* in = batch.inputs.data_ptr<int64_t>();
  auto* out = batch.targets.data_ptr<int64_t>();
  int64_t* pos = nullptr;
  if (pack_) batch.positions = at::empty({count, T}, at::kLong), pos = batch.positions.data_ptr<int64_t>();
  for (int64_t s = 0; s < count; ++s) {
    int64_t o = 0;  // where the next row starts in the sample
    for (const uint32_t ri : sample_of(first + s)) {
      const ChatRow& r = rows_[ri];
      const int64_t n = static_cast<int64_t>(r.tokens.size());
      for (int64_t t = 0; t < n && o + t < T; ++t) {
        in[s * T + o + t] = r.tokens[size_t(t)];
        if (pos) pos[s * T + o + t] = t;
      }
      // A row's first token is never a target: it would be predicted from the row before.
      for (int64_t t = 1; t < n && o + t <= T; ++t)
        if (r.counted[size_t(t)]) out[s * T + o + t - 1] = r.tokens[size_t(t)];
      o += n;
    }
    if (pos)
      for (int64_t t = o; t < T; ++t) pos[s * T + t] = t - o;  // the padding: a sequence of its own
  }
  return batch;
}

int64_t ChatSamples::counted(int64_t first, int64_t count) const {
  int64_t c = 0;
  for (int64_t s = 0; s < count; ++s) {
    int64_t o = 0;
    for (const uint32_t ri : sample_of(first + s)) {
      const ChatRow& r = rows_[ri];
      for (size_t t = 1; t < r.counted.size() && o + int64_t(t) <= seq_len_; ++t) c += r.counted[t];
      o += static_cast<int64_t>(r.tokens.size());
    }
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

ChatRow tokenize_conversation(const ChatFormat& format, const Tokenizer& tokenizer, const Conversation& conv,
                              ChatRowInfo* info) {
  std::vector<std::pair<size_t, size_t>> spans;
  std::string text;
  try {
    text = format.render(conv.messages, false, &spans);
  } catch (const std::runtime_error& e) {
    throw BadInput(fmt::format("{}: chat template {}: {}", conv.where, format.source(), e.what()));
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
  int64_t c = 0;
  for (size_t t = 1; t < row.tokens.size(); ++t) c += row.counted[t];
  if (c == 0)
    throw BadInput(
        fmt::format("{}: no assistant tokens: nothing in this conversation is trained on", conv.where));
  if (info) *info = {text.size(), row.tokens != tokenizer.encode(text)};
  return row;
}

std::vector<ChatRow> read_chat_shards(const std::string& dir, const std::string& split, int64_t vocab_size,
                                      int64_t max_tokens) {
  const ShardSet set(dir, split, vocab_size);
  if (!set.chat())
    throw BadInput(
        fmt::format("data.path: {} holds token shards without conversations' masks: write them with "
                    "`fsdpp tokenize --chat`, or read them with data.source \"shards\"",
                    dir));
  std::vector<ChatRow> rows;
  std::string begun;  // where the last conversation starts
  constexpr int64_t kChunk = 1 << 20;
  std::vector<int64_t> tokens;
  for (int64_t s = 0; s < set.segments(); ++s) {
    const auto& bin = set.segment_path(s);
    const auto mask_path = fs::path(bin).replace_extension(kChatMaskExtension).string();
    if (!fs::is_regular_file(mask_path))
      throw BadInput(fmt::format("data.path: {} has no mask file {} beside it", bin, mask_path));
    const std::string mask = read_text_file(mask_path);
    const int64_t n = set.segment_tokens(s);
    if (static_cast<int64_t>(mask.size()) != n)
      throw BadInput(fmt::format("data.path: {} is {} bytes, but {} holds {} tokens (one byte each)",
                                 mask_path, mask.size(), bin, n));
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t m = std::min(kChunk, n - c0);
      tokens.resize(size_t(m));
      set.read(s, c0, m, tokens.data());
      for (int64_t i = 0; i < m; ++i) {
        const auto bits = static_cast<uint8_t>(mask[size_t(c0 + i)]);
        if (bits & kMaskStart) {
          rows.emplace_back();
          begun = fmt::format("{} (conversation {} of the {} split, from token {})", bin, rows.size(), split,
                              c0 + i);
        } else if (rows.empty()) {
          throw BadInput(fmt::format("data.path: {}: token 0 does not start a conversation (mask byte {:#x})",
                                     mask_path, bits));
        }
        auto& row = rows.back();
        row.tokens.push_back(static_cast<int32_t>(tokens[size_t(i)]));
        row.counted.push_back(bits & kMaskCounted);
        if (static_cast<int64_t>(row.tokens.size()) > max_tokens)
          throw BadInput(
              fmt::format("data.path: {}: the conversation is longer than data.seq_len + 1 = {} tokens "
                          "(a sample holds whole conversations): raise data.seq_len",
                          begun, max_tokens));
      }
    }
  }
  return rows;
}

ChatData load_chat(const DataOptions& o, const Tokenizer& tokenizer, uint64_t seed) {
  const int64_t T = o.seq_len;
  std::vector<ChatRow> train, val;
  int64_t tokens = 0, counted = 0, split_turns = 0;
  std::string origin;
  if (!o.path.empty()) {
    // Shards of `fsdpp tokenize --chat`: rendered, tokenized and split into train and validation there.
    train = read_chat_shards(o.path, "train", tokenizer.vocab_size(), T + 1);
    val = read_chat_shards(o.path, "val", tokenizer.vocab_size(), T + 1);
    for (const auto* rows : {&train, &val})
      for (const auto& r : *rows) {
        tokens += static_cast<int64_t>(r.tokens.size());
        for (size_t t = 1; t < r.counted.size(); ++t) counted += r.counted[t];
      }
    origin = fmt::format("{} conversations from the shards in {} ({} held out)", train.size() + val.size(),
                         o.path, val.size());
  } else {
    const ChatFormat format(tokenizer, o.chat_template);
    std::vector<Conversation> lines;
    size_t files = 0;
    for (const auto& root : o.paths)
      for (const auto& path : list_text_files(root)) {
        ++files;
        for (auto& c : read_conversations(path)) lines.push_back(std::move(c));
      }
    if (lines.empty()) throw BadInput(fmt::format("data.paths: no conversations in {} file(s)", files));
    uint64_t draw = seed ^ 0xC4A7ULL;
    for (const auto& line : lines) {
      ChatRowInfo info;
      ChatRow row = tokenize_conversation(format, tokenizer, line, &info);
      split_turns += info.split_at_edges;
      const int64_t n = static_cast<int64_t>(row.tokens.size());
      if (n > T + 1)
        throw BadInput(fmt::format(
            "{}: the conversation is {} tokens, longer than data.seq_len + 1 = {} (a sample holds "
            "whole conversations): shorten it or raise data.seq_len",
            line.where, n, T + 1));
      tokens += n;
      for (int64_t t = 1; t < n; ++t) counted += row.counted[size_t(t)];
      (uniform01(draw) < o.val_fraction ? val : train).push_back(std::move(row));
    }
    if (val.empty() && train.size() > 1) val.push_back(train.back()), train.pop_back();
    if (val.empty()) val = train;
    origin = fmt::format("{} conversations from {} file(s) ({} held out); template {}{}", lines.size(), files,
                         val.size(), format.source(),
                         split_turns ? fmt::format("; {} tokenized apart at turn edges where the whole text "
                                                   "tokenizes otherwise",
                                                   split_turns)
                                     : "");
  }
  if (train.empty() || val.empty())
    throw BadInput(fmt::format("data.path: {} holds no conversations in its {} split", o.path,
                               train.empty() ? "train" : "val"));
  const int32_t pad = tokenizer.eot() >= 0 ? tokenizer.eot() : 0;
  ChatData d;
  d.train = std::make_shared<ChatSamples>(std::move(train), T, pad, seed, true, o.pack);
  d.val = std::make_shared<ChatSamples>(std::move(val), T, pad, 0, false, o.pack);
  d.description = fmt::format(
      "chat: {}; {} tokens, {:.0f}% of them assistant targets; {}", origin, tokens,
      100.0 * double(counted) / double(std::max<int64_t>(1, tokens)),
      o.pack ? fmt::format("packed into {} training samples of {} tokens, {:.0f}% filled", d.train->size(),
                           T + 1, 100.0 * d.train->fill())
             : fmt::format("one per sample, {:.0f}% of the samples' tokens filled (data.pack fills more)",
                           100.0 * d.train->fill()));
  return d;
}

}  // namespace fsdpp::train
