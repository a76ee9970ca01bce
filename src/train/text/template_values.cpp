// chat_template.hpp's values: Python's str, repr, ==, +, in; json.dumps as transformers' tojson;
// the methods of strings, dicts and lists that published templates call.
#include "template_values.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

#include "unicode.hpp"

namespace fsdpp::train::text::jinja {

using Kind = Value::Kind;

[[noreturn]] void fail(int line, const std::string& what) {
  throw std::runtime_error(fmt::format("line {}: {}", line, what));
}

const char* kind_name(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
      return "undefined";
    case Kind::none:
      return "none";
    case Kind::boolean:
      return "a boolean";
    case Kind::integer:
      return "an integer";
    case Kind::number:
      return "a float";
    case Kind::string:
      return "a string";
    case Kind::list:
      return "a list";
    case Kind::dict:
      return "a dict";
    case Kind::function:
      return "a function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
    case Kind::none:
      return false;
    case Kind::boolean:
      return v.b;
    case Kind::integer:
      return v.i != 0;
    case Kind::number:
      return v.d != 0;
    case Kind::string:
      return !v.s.empty();
    case Kind::list:
      return !v.list->empty();
    case Kind::dict:
      return !v.dict->empty();
    case Kind::function:
      return true;
  }
  return false;
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", d);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out.push_back(ch);
    }
  }
  return out + "\"";
}

std::string repr(const Value& v) {
  if (v.kind != Kind::string) return str(v);
  const bool double_quotes = v.s.find('\'') != std::string::npos && v.s.find('"') == std::string::npos;
  const char q = double_quotes ? '"' : '\'';
  std::string out(1, q);
  for (const char ch : v.s) {
    if (ch == '\\')
      out += "\\\\";
    else if (ch == q)
      out += std::string("\\") + q;
    else if (ch == '\n')
      out += "\\n";
    else if (ch == '\r')
      out += "\\r";
    else if (ch == '\t')
      out += "\\t";
    else
      out.push_back(ch);
  }
  return out + q;
}

// Python's str().
std::string str(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
      return "";
    case Kind::none:
      return "None";
    case Kind::boolean:
      return v.b ? "True" : "False";
    case Kind::integer:
      return std::to_string(v.i);
    case Kind::number:
      return float_repr(v.d);
    case Kind::string:
      return v.s;
    case Kind::list: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      return out + "]";
    }
    case Kind::dict: {
      std::string out = "{";
      for (size_t k = 0; k < v.dict->size(); ++k)
        out += (k ? ", " : "") + repr(Value::string((*v.dict)[k].first)) + ": " + repr((*v.dict)[k].second);
      return out + "}";
    }
    case Kind::function:
      return "<function>";
  }
  return "";
}

// json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=...), as transformers' tojson.
std::string to_json(const Value& v, int indent, bool sort_keys, int depth) {
  const std::string nl = indent >= 0 ? "\n" + std::string(size_t(indent * (depth + 1)), ' ') : "";
  const std::string close = indent >= 0 ? "\n" + std::string(size_t(indent * depth), ' ') : "";
  const std::string comma = indent >= 0 ? "," : ", ";
  switch (v.kind) {
    case Kind::undefined:
    case Kind::none:
      return "null";
    case Kind::boolean:
      return v.b ? "true" : "false";
    case Kind::integer:
      return std::to_string(v.i);
    case Kind::number:
      return std::isnan(v.d)   ? "NaN"
             : std::isinf(v.d) ? (v.d > 0 ? "Infinity" : "-Infinity")
                               : float_repr(v.d);
    case Kind::string:
      return json_string(v.s);
    case Kind::list: {
      if (v.list->empty()) return "[]";
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k)
        out += (k ? comma : "") + nl + to_json((*v.list)[k], indent, sort_keys, depth + 1);
      return out + close + "]";
    }
    case Kind::dict: {
      if (v.dict->empty()) return "{}";
      Dict d = *v.dict;
      if (sort_keys)
        std::stable_sort(d.begin(), d.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      std::string out = "{";
      for (size_t k = 0; k < d.size(); ++k)
        out += (k ? comma : "") + nl + json_string(d[k].first) + ": " +
               to_json(d[k].second, indent, sort_keys, depth + 1);
      return out + close + "}";
    }
    case Kind::function:
      return "null";
  }
  return "null";
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& e : j) l.push_back(from_json(e));
      return Value::of_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, e] : j.items()) d.emplace_back(k, from_json(e));
      return Value::of_dict(std::move(d));
    }
    default:
      return Value();
  }
}

bool equal(const Value& a, const Value& b) {
  const auto numeric = [](const Value& v) {
    return v.kind == Kind::integer || v.kind == Kind::number || v.kind == Kind::boolean;
  };
  const auto as_double = [](const Value& v) {
    return v.kind == Kind::number ? v.d : v.kind == Kind::integer ? double(v.i) : double(v.b);
  };
  if (numeric(a) && numeric(b)) return as_double(a) == as_double(b);
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::string:
      return a.s == b.s;
    case Kind::list:
      return a.list->size() == b.list->size() &&
             std::equal(a.list->begin(), a.list->end(), b.list->begin(),
                        [](const Value& x, const Value& y) { return equal(x, y); });
    case Kind::dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* o = b.find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    default:
      return true;  // undefined, none
  }
}

std::vector<Value> items_of(const Value& v, int line) {
  switch (v.kind) {
    case Kind::undefined:
      return {};
    case Kind::list:
      return *v.list;
    case Kind::dict: {
      std::vector<Value> keys;
      for (const auto& [k, e] : *v.dict) keys.push_back(Value::string(k));
      return keys;
    }
    case Kind::string: {
      std::vector<Value> chars;
      for (size_t i = 0; i < v.s.size();) {
        const size_t at = i;
        i += char_bytes(static_cast<unsigned char>(v.s[i]));
        chars.push_back(Value::string(v.s.substr(at, i - at)));
      }
      return chars;
    }
    default:
      fail(line, fmt::format("{} cannot be iterated", kind_name(v)));
  }
}

std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
  const auto in = [&](char c) {
    return chars.empty() ? std::isspace(static_cast<unsigned char>(c)) != 0
                         : chars.find(c) != std::string::npos;
  };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && in(s[b])) ++b;
  if (right)
    while (e > b && in(s[e - 1])) --e;
  return s.substr(b, e - b);
}

Value arg(const Args& a, size_t k, const Kwargs& kw, const char* key, Value fallback) {
  for (const auto& [name, v] : kw)
    if (name == key) return v;
  return k < a.size() ? a[k] : fallback;
}

Value binary(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "~") return Value::string(str(a) + str(b));
  if (op == "==") return Value::boolean(equal(a, b));
  if (op == "!=") return Value::boolean(!equal(a, b));
  if (op == "in" || op == "not in") {
    bool found = false;
    if (b.kind == Kind::string)
      found = b.s.find(str(a)) != std::string::npos;
    else if (b.kind == Kind::dict)
      found = b.find(str(a)) != nullptr;
    else if (b.kind == Kind::list)
      found = std::any_of(b.list->begin(), b.list->end(), [&](const Value& x) { return equal(a, x); });
    else if (b.kind != Kind::undefined)
      fail(line, fmt::format("\"in\" {}", kind_name(b)));
    return Value::boolean(found == (op == "in"));
  }
  const bool ints = a.kind == Kind::integer && b.kind == Kind::integer;
  const bool nums = (a.kind == Kind::integer || a.kind == Kind::number) &&
                    (b.kind == Kind::integer || b.kind == Kind::number);
  const auto da = a.kind == Kind::number ? a.d : double(a.i), db = b.kind == Kind::number ? b.d : double(b.i);
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    int c;
    if (nums)
      c = da < db ? -1 : da > db ? 1 : 0;
    else if (a.kind == Kind::string && b.kind == Kind::string)
      c = a.s.compare(b.s);
    else
      fail(line, fmt::format("cannot compare {} with {}", kind_name(a), kind_name(b)));
    return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
  }
  if (op == "+") {
    if (ints) return Value::integer(a.i + b.i);
    if (nums) return Value::number(da + db);
    if (a.kind == Kind::string && b.kind == Kind::string) return Value::string(a.s + b.s);
    if (a.kind == Kind::list && b.kind == Kind::list) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::of_list(std::move(l));
    }
    fail(line, fmt::format("cannot add {} and {}", kind_name(a), kind_name(b)));
  }
  if (op == "*" && a.kind == Kind::string && b.kind == Kind::integer) {
    std::string s;
    for (int64_t k = 0; k < b.i; ++k) s += a.s;
    return Value::string(std::move(s));
  }
  if (!nums) fail(line, fmt::format("cannot apply {} to {} and {}", op, kind_name(a), kind_name(b)));
  if (op == "-") return ints ? Value::integer(a.i - b.i) : Value::number(da - db);
  if (op == "*") return ints ? Value::integer(a.i * b.i) : Value::number(da * db);
  if (op == "/") {
    if (db == 0) fail(line, "division by zero");
    return Value::number(da / db);
  }
  if (db == 0) fail(line, "division by zero");
  if (op == "//")
    return ints ? Value::integer(int64_t(std::floor(da / db))) : Value::number(std::floor(da / db));
  if (op == "%") {
    if (ints) return Value::integer(((a.i % b.i) + b.i) % b.i);
    return Value::number(da - db * std::floor(da / db));
  }
  fail(line, fmt::format("unknown operator {}", op));
}

static Value method(Function f) { return Value::function(std::move(f)); }

Value attribute(const Value& on, const std::string& name, int line) {
  if (on.kind == Kind::undefined) fail(line, fmt::format("\"{}\" of an undefined value", name));
  if (on.kind == Kind::dict) {
    if (const Value* v = on.find(name)) return *v;
    const auto d = on.dict;
    if (name == "items")
      return method([d](const Args&, const Kwargs&) {
        List l;
        for (const auto& [k, v] : *d) l.push_back(Value::of_list({Value::string(k), v}));
        return Value::of_list(std::move(l));
      });
    if (name == "keys" || name == "values")
      return method([d, name](const Args&, const Kwargs&) {
        List l;
        for (const auto& [k, v] : *d) l.push_back(name == "keys" ? Value::string(k) : v);
        return Value::of_list(std::move(l));
      });
    if (name == "get")
      return method([on](const Args& a, const Kwargs&) {
        const Value* v = a.empty() ? nullptr : on.find(str(a[0]));
        return v ? *v : a.size() > 1 ? a[1] : Value::none();
      });
    return Value();
  }
  if (on.kind == Kind::string) {
    const std::string s = on.s;
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return method([s, name](const Args& a, const Kwargs&) {
        return Value::string(strip_chars(s, a.empty() || a[0].kind != Kind::string ? "" : a[0].s,
                                         name != "rstrip", name != "lstrip"));
      });
    if (name == "upper" || name == "lower")
      return method([s, name](const Args&, const Kwargs&) {
        std::string r = s;
        for (auto& c : r)
          c = static_cast<char>(name == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                                : std::tolower(static_cast<unsigned char>(c)));
        return Value::string(std::move(r));
      });
    if (name == "startswith" || name == "endswith")
      return method([s, name](const Args& a, const Kwargs&) {
        const std::string p = a.empty() ? "" : str(a[0]);
        return Value::boolean(name == "startswith" ? s.starts_with(p) : s.ends_with(p));
      });
    if (name == "split")
      return method([s](const Args& a, const Kwargs&) {
        List l;
        if (a.empty() || a[0].kind == Kind::none) {
          size_t i = 0;
          while (i < s.size()) {
            while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
            size_t j = i;
            while (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j]))) ++j;
            if (j > i) l.push_back(Value::string(s.substr(i, j - i)));
            i = j;
          }
        } else {
          const std::string sep = str(a[0]);
          size_t i = 0;
          for (size_t j; !sep.empty() && (j = s.find(sep, i)) != std::string::npos; i = j + sep.size())
            l.push_back(Value::string(s.substr(i, j - i)));
          l.push_back(Value::string(s.substr(i)));
        }
        return Value::of_list(std::move(l));
      });
    if (name == "replace")
      return method([s](const Args& a, const Kwargs&) {
        if (a.size() < 2 || str(a[0]).empty()) return Value::string(s);
        std::string r, from = str(a[0]), to = str(a[1]);
        size_t i = 0;
        for (size_t j; (j = s.find(from, i)) != std::string::npos; i = j + from.size())
          r += s.substr(i, j - i) + to;
        return Value::string(r + s.substr(i));
      });
  }
  if (on.kind == Kind::list && name == "append") {
    const auto l = on.list;
    return method([l](const Args& a, const Kwargs&) {
      for (const auto& v : a) l->push_back(v);
      return Value::none();
    });
  }
  return Value();
}

}  // namespace fsdpp::train::text::jinja
