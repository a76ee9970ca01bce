#pragma once
// The values of chat_template.hpp's Jinja subset, as Python's: truthiness, str and repr, equality,
// operators, iteration, attributes and methods; json.dumps as transformers' tojson.
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "template_ast.hpp"

namespace fsdpp::train::text::jinja {

// An evaluation error at a template line (std::runtime_error "line N: ...").
[[noreturn]] void fail(int line, const std::string& what);

// The template's own raise_exception, which names no line.
struct Raised : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const char* kind_name(const Value& v);
bool truthy(const Value& v);
std::string str(const Value& v);   // Python's str()
std::string repr(const Value& v);  // Python's repr()
// json.dumps(v, ensure_ascii=False, indent=indent (< 0: None), sort_keys=sort_keys)
std::string to_json(const Value& v, int indent, bool sort_keys, int depth = 0);
Value from_json(const nlohmann::ordered_json& j);
bool equal(const Value& a, const Value& b);
// What a for loop visits: a list's items, a dict's keys, a string's characters, nothing for undefined.
std::vector<Value> items_of(const Value& v, int line);
// Python's str.strip(chars) (chars empty: whitespace), from the left, the right or both.
std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right);
// Argument `key`, or positional argument k, or `fallback`.
Value arg(const Args& a, size_t k, const Kwargs& kw, const char* key, Value fallback = Value());
// a op b for the binary operators (+ - * / // % ~ == != < > <= >= in, not in).
Value binary(const std::string& op, const Value& a, const Value& b, int line);
// on.name: a dict's item, or a bound method of a string, dict or list; undefined when neither.
Value attribute(const Value& on, const std::string& name, int line);

}  // namespace fsdpp::train::text::jinja
