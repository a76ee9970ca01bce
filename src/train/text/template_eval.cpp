// Rendering chat_template.hpp's Jinja subset: statements, expressions, filters and tests as
// Jinja's (values: template_values.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <stdexcept>
#include <unordered_map>

#include "chat_template.hpp"
#include "template_ast.hpp"
#include "template_values.hpp"
#include "unicode.hpp"

namespace fsdpp::train::text {

namespace jinja {
namespace {

using Kind = Value::Kind;

class Renderer {
 public:
  Renderer(const nlohmann::ordered_json& variables, std::vector<std::pair<size_t, size_t>>* generated)
      : generated_(generated) {
    scopes_.emplace_back();
    auto& g = scopes_.back();
    g["raise_exception"] = Value::function([](const Args& a, const Kwargs&) -> Value {
      throw Raised(a.empty() ? "raise_exception" : str(a[0]));
    });
    g["namespace"] = Value::function([](const Args&, const Kwargs& kw) {
      Dict d(kw.begin(), kw.end());
      return Value::of_dict(std::move(d));
    });
    g["range"] = Value::function([](const Args& a, const Kwargs&) {
      int64_t from = 0, to = 0, step = 1;
      if (a.size() == 1) to = a[0].i;
      if (a.size() >= 2) from = a[0].i, to = a[1].i;
      if (a.size() >= 3) step = a[2].i ? a[2].i : 1;
      List l;
      for (int64_t i = from; step > 0 ? i < to : i > to; i += step) l.push_back(Value::integer(i));
      return Value::of_list(std::move(l));
    });
    g["strftime_now"] = Value::function([](const Args& a, const Kwargs&) {
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, a.empty() ? "%Y-%m-%d" : str(a[0]).c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
    if (variables.is_object())
      for (const auto& [k, v] : variables.items()) g[k] = from_json(v);
  }

  std::string run(const Body& body) {
    exec(body);
    return std::move(out_);
  }

 private:
  enum class Flow { next, break_, continue_ };

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it)
      if (const auto f = it->find(name); f != it->end()) return f->second;
    return Value();
  }

  Flow exec(const Body& body) {
    for (const auto& n : body) {
      const Flow f = exec(*n);
      if (f != Flow::next) return f;
    }
    return Flow::next;
  }

  Flow exec(const Node& n) {
    switch (n.kind) {
      case Node::Kind::text:
        out_ += n.text;
        return Flow::next;
      case Node::Kind::output:
        out_ += str(eval(*n.expr));
        return Flow::next;
      case Node::Kind::break_:
        return Flow::break_;
      case Node::Kind::continue_:
        return Flow::continue_;
      case Node::Kind::generation: {
        const size_t begin = out_.size();
        const Flow f = exec(n.body);
        if (generated_) generated_->emplace_back(begin, out_.size());
        return f;
      }
      case Node::Kind::set: {
        Value v = eval(*n.expr);
        if (n.targets.size() == 1) {
          scopes_.back()[n.targets[0]] = std::move(v);
        } else {
          Value ns = lookup(n.targets[0]);
          if (ns.kind != Kind::dict) fail(n.line, fmt::format("{} is not a namespace", n.targets[0]));
          for (auto& [k, e] : *ns.dict)
            if (k == n.targets[1]) {
              e = std::move(v);
              return Flow::next;
            }
          ns.dict->emplace_back(n.targets[1], std::move(v));
        }
        return Flow::next;
      }
      case Node::Kind::if_:
        for (const auto& [condition, body] : n.branches)
          if (truthy(eval(*condition))) return exec(body);
        return exec(n.else_body);
      case Node::Kind::for_: {
        const Value iterable = eval(*n.expr);
        if (iterable.kind == Kind::none) fail(n.line, "none cannot be iterated");
        std::vector<Value> items = items_of(iterable, n.line);
        const auto bind = [&](const Value& item) {
          if (n.targets.size() == 1) {
            scopes_.back()[n.targets[0]] = item;
            return;
          }
          const auto parts = items_of(item, n.line);
          if (parts.size() != n.targets.size())
            fail(n.line,
                 fmt::format("cannot unpack {} values into {} names", parts.size(), n.targets.size()));
          for (size_t k = 0; k < parts.size(); ++k) scopes_.back()[n.targets[k]] = parts[k];
        };
        if (n.condition) {  // "for x in xs if c": loop.* counts the items kept
          std::vector<Value> kept;
          for (const auto& item : items) {
            scopes_.emplace_back();
            bind(item);
            if (truthy(eval(*n.condition))) kept.push_back(item);
            scopes_.pop_back();
          }
          items = std::move(kept);
        }
        const int64_t count = static_cast<int64_t>(items.size());
        for (int64_t k = 0; k < count; ++k) {
          scopes_.emplace_back();
          bind(items[k]);
          Dict loop{{"index", Value::integer(k + 1)},
                    {"index0", Value::integer(k)},
                    {"first", Value::boolean(k == 0)},
                    {"last", Value::boolean(k + 1 == count)},
                    {"length", Value::integer(count)},
                    {"revindex", Value::integer(count - k)},
                    {"revindex0", Value::integer(count - k - 1)},
                    {"previtem", k > 0 ? items[k - 1] : Value()},
                    {"nextitem", k + 1 < count ? items[k + 1] : Value()}};
          scopes_.back()["loop"] = Value::of_dict(std::move(loop));
          const Flow f = exec(n.body);
          scopes_.pop_back();
          if (f == Flow::break_) break;
        }
        if (count == 0) return exec(n.else_body);
        return Flow::next;
      }
    }
    return Flow::next;
  }

  Value eval(const Expr& e) {
    switch (e.op) {
      case Expr::Op::literal:
        return e.value;
      case Expr::Op::name:
        return lookup(e.name);
      case Expr::Op::list: {
        List l;
        for (const auto& a : e.args) l.push_back(eval(*a));
        return Value::of_list(std::move(l));
      }
      case Expr::Op::dict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2)
          d.emplace_back(str(eval(*e.args[k])), eval(*e.args[k + 1]));
        return Value::of_dict(std::move(d));
      }
      case Expr::Op::attr:
        return attribute(eval(*e.args[0]), e.name, e.line);
      case Expr::Op::item: {
        const Value on = eval(*e.args[0]), key = eval(*e.args[1]);
        if (on.kind == Kind::undefined) fail(e.line, "an item of an undefined value");
        if (on.kind == Kind::dict) {
          const Value* v = on.find(str(key));
          return v ? *v : Value();
        }
        if (on.kind == Kind::list || on.kind == Kind::string) {
          if (key.kind != Kind::integer) return attribute(on, str(key), e.line);
          const auto items = on.kind == Kind::list ? *on.list : items_of(on, e.line);
          int64_t i = key.i < 0 ? key.i + int64_t(items.size()) : key.i;
          return i >= 0 && i < int64_t(items.size()) ? items[size_t(i)] : Value();
        }
        fail(e.line, fmt::format("{} has no items", kind_name(on)));
      }
      case Expr::Op::slice: {
        const Value on = eval(*e.args[0]);
        const auto items = items_of(on, e.line);
        const int64_t n = int64_t(items.size());
        const auto bound = [&](const ExprPtr& x, int64_t fallback) {
          if (!x) return fallback;
          int64_t v = eval(*x).i;
          if (v < 0) v += n;
          return std::clamp<int64_t>(v, 0, n);
        };
        const int64_t from = bound(e.args[1], 0), to = bound(e.args[2], n);
        List part(items.begin() + from, items.begin() + std::max(from, to));
        if (on.kind != Kind::string) return Value::of_list(std::move(part));
        std::string s;
        for (const auto& c : part) s += c.s;
        return Value::string(std::move(s));
      }
      case Expr::Op::call: {
        const Value f = eval(*e.args[0]);
        if (f.kind != Kind::function)
          fail(e.line, fmt::format("{} is not callable",
                                   e.args[0]->op == Expr::Op::name ? e.args[0]->name : kind_name(f)));
        Args a;
        for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k]));
        Kwargs kw;
        for (const auto& [k, x] : e.kwargs) kw.emplace_back(k, eval(*x));
        try {
          return (*f.fn)(a, kw);
        } catch (const Raised&) {
          throw;
        } catch (const std::exception& ex) {
          fail(e.line, ex.what());
        }
      }
      case Expr::Op::filter:
        return filter(e);
      case Expr::Op::test:
        return Value::boolean(test(e) != e.negated);
      case Expr::Op::unary_not:
        return Value::boolean(!truthy(eval(*e.args[0])));
      case Expr::Op::negate: {
        const Value v = eval(*e.args[0]);
        if (v.kind == Kind::integer) return Value::integer(-v.i);
        if (v.kind == Kind::number) return Value::number(-v.d);
        fail(e.line, fmt::format("cannot negate {}", kind_name(v)));
      }
      case Expr::Op::and_: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? eval(*e.args[1]) : a;
      }
      case Expr::Op::or_: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? a : eval(*e.args[1]);
      }
      case Expr::Op::conditional:
        if (truthy(eval(*e.args[0]))) return eval(*e.args[1]);
        return e.args.size() > 2 ? eval(*e.args[2]) : Value();
      case Expr::Op::binary:
        return binary(e.name, eval(*e.args[0]), eval(*e.args[1]), e.line);
    }
    return Value();
  }

  bool test(const Expr& e) {
    const Value v = eval(*e.args[0]);
    const std::string& t = e.name;
    if (t == "defined") return v.defined();
    if (t == "undefined") return !v.defined();
    if (t == "none") return v.kind == Kind::none;
    if (t == "string") return v.kind == Kind::string;
    if (t == "number") return v.kind == Kind::integer || v.kind == Kind::number;
    if (t == "integer") return v.kind == Kind::integer;
    if (t == "float") return v.kind == Kind::number;
    if (t == "boolean") return v.kind == Kind::boolean;
    if (t == "true") return v.kind == Kind::boolean && v.b;
    if (t == "false") return v.kind == Kind::boolean && !v.b;
    if (t == "mapping") return v.kind == Kind::dict;
    if (t == "sequence") return v.kind == Kind::list || v.kind == Kind::string || v.kind == Kind::dict;
    if (t == "iterable") return v.kind == Kind::list || v.kind == Kind::string || v.kind == Kind::dict;
    if (t == "callable") return v.kind == Kind::function;
    if (t == "even" || t == "odd") return v.kind == Kind::integer && (v.i % 2 == 0) == (t == "even");
    if (t == "divisibleby")
      return v.kind == Kind::integer && e.args.size() > 1 && eval(*e.args[1]).i != 0 &&
             v.i % eval(*e.args[1]).i == 0;
    if (t == "equalto" || t == "eq" || t == "sameas") return e.args.size() > 1 && equal(v, eval(*e.args[1]));
    if (t == "in") return e.args.size() > 1 && truthy(binary("in", v, eval(*e.args[1]), e.line));
    fail(e.line, fmt::format("the test \"{}\" is not supported", t));
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    Args a;
    for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k]));
    Kwargs kw;
    for (const auto& [k, x] : e.kwargs) kw.emplace_back(k, eval(*x));
    const std::string& f = e.name;
    if (f == "trim") return Value::string(strip_chars(str(v), a.empty() ? "" : str(a[0]), true, true));
    if (f == "length" || f == "count") {
      if (v.kind == Kind::string) {
        int64_t n = 0;
        for (size_t i = 0; i < v.s.size(); i += char_bytes(static_cast<unsigned char>(v.s[i]))) ++n;
        return Value::integer(n);
      }
      return Value::integer(int64_t(items_of(v, e.line).size()));
    }
    if (f == "tojson") {
      const Value indent = arg(a, 0, kw, "indent", Value::none());
      return Value::string(
          to_json(v, indent.kind == Kind::integer ? int(indent.i) : -1, truthy(arg(a, 1, kw, "sort_keys"))));
    }
    if (f == "upper" || f == "lower")
      return attribute(Value::string(str(v)), f, e.line).fn->operator()({}, {});
    if (f == "string") return Value::string(str(v));
    if (f == "safe") return v;
    if (f == "default" || f == "d") {
      const bool boolean = truthy(arg(a, 1, kw, "boolean"));
      return (boolean ? truthy(v) : v.defined()) ? v : arg(a, 0, kw, "default_value", Value::string(""));
    }
    if (f == "first" || f == "last") {
      const auto items = items_of(v, e.line);
      return items.empty() ? Value() : f == "first" ? items.front() : items.back();
    }
    if (f == "list") return Value::of_list(items_of(v, e.line));
    if (f == "reverse") {
      auto items = items_of(v, e.line);
      std::reverse(items.begin(), items.end());
      if (v.kind != Kind::string) return Value::of_list(std::move(items));
      std::string s;
      for (const auto& c : items) s += c.s;
      return Value::string(s);
    }
    if (f == "join") {
      const std::string sep = a.empty() ? "" : str(a[0]);
      std::string s;
      const auto items = items_of(v, e.line);
      for (size_t k = 0; k < items.size(); ++k) s += (k ? sep : "") + str(items[k]);
      return Value::string(s);
    }
    if (f == "replace") return attribute(Value::string(str(v)), "replace", e.line).fn->operator()(a, {});
    if (f == "capitalize") {
      std::string s = str(v);
      for (size_t k = 0; k < s.size(); ++k)
        s[k] = static_cast<char>(k ? std::tolower(static_cast<unsigned char>(s[k]))
                                   : std::toupper(static_cast<unsigned char>(s[k])));
      return Value::string(s);
    }
    if (f == "int") {
      if (v.kind == Kind::integer) return v;
      if (v.kind == Kind::number) return Value::integer(int64_t(v.d));
      try {
        return Value::integer(std::stoll(str(v)));
      } catch (...) {
        return Value::integer(0);
      }
    }
    if (f == "items") return attribute(v, "items", e.line).fn->operator()({}, {});
    if (f == "map" || f == "selectattr" || f == "rejectattr") {
      // map(attribute="x"); selectattr("x"), selectattr("x", "equalto", y) and the reverse.
      const auto items = items_of(v, e.line);
      List out;
      const std::string key = f == "map" ? str(arg(a, 0, kw, "attribute")) : a.empty() ? "" : str(a[0]);
      for (const auto& item : items) {
        const Value got = item.kind == Kind::dict ? (item.find(key) ? *item.find(key) : Value()) : Value();
        if (f == "map") {
          out.push_back(got);
          continue;
        }
        bool keep = a.size() >= 3                             ? equal(got, a[2])
                    : a.size() == 2 && str(a[1]) == "defined" ? got.defined()
                                                              : truthy(got);
        if (keep == (f == "selectattr")) out.push_back(item);
      }
      return Value::of_list(std::move(out));
    }
    fail(e.line, fmt::format("the filter \"{}\" is not supported", f));
  }

  std::vector<std::unordered_map<std::string, Value>> scopes_;
  std::string out_;
  std::vector<std::pair<size_t, size_t>>* generated_;
};

}  // namespace
}  // namespace jinja

ChatTemplate::ChatTemplate(const std::string& source)
    : body_(std::make_shared<const jinja::Body>(jinja::parse(source))) {}
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const nlohmann::ordered_json& variables,
                                 std::vector<std::pair<size_t, size_t>>* generated) const {
  if (generated) generated->clear();
  try {
    return jinja::Renderer(variables, generated).run(*body_);
  } catch (const jinja::Raised& e) {
    throw std::runtime_error(fmt::format("the template refused the conversation: {}", e.what()));
  }
}

}  // namespace fsdpp::train::text
