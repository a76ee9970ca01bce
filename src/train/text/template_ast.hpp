#pragma once
// The parts of chat_template.cpp's Jinja subset: values, expressions and statements. Values follow
// Python's (what transformers' Jinja renders with): none, booleans, integers, floats, strings, lists
// and dicts (insertion-ordered), plus Jinja's undefined and a few callables.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp::train::text::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(const Args&, const Kwargs&)>;

struct Value {
  enum class Kind { undefined, none, boolean, integer, number, string, list, dict, function };
  Kind kind = Kind::undefined;
  bool b = false;
  int64_t i = 0;
  double d = 0;
  std::string s;
  std::shared_ptr<List> list;  // shared: a namespace or a list appended to is changed in place
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Function> fn;

  static Value none() { return make(Kind::none); }
  static Value boolean(bool v) {
    Value x = make(Kind::boolean);
    x.b = v;
    return x;
  }
  static Value integer(int64_t v) {
    Value x = make(Kind::integer);
    x.i = v;
    return x;
  }
  static Value number(double v) {
    Value x = make(Kind::number);
    x.d = v;
    return x;
  }
  static Value string(std::string v) {
    Value x = make(Kind::string);
    x.s = std::move(v);
    return x;
  }
  static Value of_list(List v) {
    Value x = make(Kind::list);
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value of_dict(Dict v) {
    Value x = make(Kind::dict);
    x.dict = std::make_shared<Dict>(std::move(v));
    return x;
  }
  static Value function(Function f) {
    Value x = make(Kind::function);
    x.fn = std::make_shared<Function>(std::move(f));
    return x;
  }
  bool defined() const { return kind != Kind::undefined; }
  // The dict's value at `key`, or nullptr.
  const Value* find(const std::string& key) const {
    if (kind != Kind::dict) return nullptr;
    for (const auto& [k, v] : *dict)
      if (k == key) return &v;
    return nullptr;
  }

 private:
  static Value make(Kind k) {
    Value x;
    x.kind = k;
    return x;
  }
};

struct Expr {
  enum class Op {
    literal,
    name,
    list,
    dict,
    attr,
    item,
    slice,
    call,
    filter,
    test,
    unary_not,
    negate,
    binary,
    conditional,
    and_,
    or_
  };
  Op op;
  Value value;                              // literal
  std::string name;                         // name, attr, filter, test, binary operator
  bool negated = false;                     // test: "is not"
  std::vector<std::unique_ptr<Expr>> args;  // operands, then positional arguments
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  int line = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind { text, output, if_, for_, set, generation, break_, continue_ };
  Kind kind;
  std::string text;                                // text
  ExprPtr expr;                                    // output, set's value, for's iterable
  std::vector<std::pair<ExprPtr, Body>> branches;  // if / elif
  Body body, else_body;                            // for, generation; if's and for's else
  std::vector<std::string> targets;                // for's names; set's name (and attribute)
  ExprPtr condition;                               // for ... if condition
  int line = 0;
};

// The template as parsed (whitespace control applied). Throws std::invalid_argument naming the line.
Body parse(const std::string& source);

}  // namespace fsdpp::train::text::jinja
