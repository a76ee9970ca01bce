#pragma once
// Chat templates: the Jinja a tokenizer_config.json ("chat_template") or chat_template.jinja holds,
// rendered as transformers' apply_chat_template renders it (Jinja with trim_blocks and
// lstrip_blocks, raise_exception, strftime_now, tojson as transformers defines it, and the
// {% generation %} marker of assistant text). A subset of Jinja: the statements if, for (with
// loop.*, else and a condition), set (namespaces too), break, continue; Python's values and
// operators, the filters and tests published templates use (docs/data.md lists them).
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp::train::text {

namespace jinja {
struct Node;
}

class ChatTemplate {
 public:
  // Throws std::invalid_argument ("line N: ...") for a template outside the subset.
  explicit ChatTemplate(const std::string& source);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;

  // `variables` holds messages, add_generation_prompt, bos_token, eos_token and whatever else the
  // template reads. Throws std::runtime_error: the template's own raise_exception message, or an
  // evaluation error naming the line. `generated`, when given, receives the [begin, end) byte
  // ranges of the output that {% generation %} blocks wrote.
  std::string render(const nlohmann::ordered_json& variables,
                     std::vector<std::pair<size_t, size_t>>* generated = nullptr) const;

 private:
  std::shared_ptr<const std::vector<std::unique_ptr<jinja::Node>>> body_;
};

}  // namespace fsdpp::train::text
