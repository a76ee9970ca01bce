// The Jinja subset that published chat templates use, parsed as transformers' environment parses
// them (trim_blocks and lstrip_blocks on, the template's one trailing newline dropped).
#include <fmt/format.h>

#include <cctype>
#include <stdexcept>

#include "template_ast.hpp"
#include "template_lex.hpp"

namespace fsdpp::train::text::jinja {

namespace {

class ExprParser {
 public:
  ExprParser(std::vector<Token> tokens, int line) : t_(std::move(tokens)), line_(line) {}

  ExprPtr expression() {
    auto e = or_();
    if (word("if")) {
      auto c = make(Expr::Op::conditional);
      auto condition = or_();
      c->args.push_back(std::move(condition));
      c->args.push_back(std::move(e));
      if (word("else")) c->args.push_back(expression());
      return c;
    }
    return e;
  }
  ExprPtr without_conditional() { return or_(); }  // a for loop's iterable, before its "if"
  bool at_end() const { return t_[p_].kind == Token::Kind::end; }
  bool word(const char* w) {
    if (t_[p_].kind == Token::Kind::name && t_[p_].text == w) return ++p_, true;
    return false;
  }
  bool op(const char* o) {
    if (t_[p_].kind == Token::Kind::op && t_[p_].text == o) return ++p_, true;
    return false;
  }
  std::string name() {
    if (t_[p_].kind != Token::Kind::name)
      parse_fail(line_, fmt::format("expected a name, found \"{}\"", t_[p_].text));
    return t_[p_++].text;
  }
  void expect(const char* o) {
    if (!op(o)) parse_fail(line_, fmt::format("expected \"{}\", found \"{}\"", o, t_[p_].text));
  }
  const Token& peek() const { return t_[p_]; }

 private:
  ExprPtr make(Expr::Op o) {
    auto e = std::make_unique<Expr>();
    e->op = o;
    e->line = line_;
    return e;
  }
  ExprPtr binary(const std::string& o, ExprPtr a, ExprPtr b) {
    auto e = make(o == "and" ? Expr::Op::and_ : o == "or" ? Expr::Op::or_ : Expr::Op::binary);
    e->name = o;
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }
  ExprPtr or_() {
    auto e = and_();
    while (word("or")) e = binary("or", std::move(e), and_());
    return e;
  }
  ExprPtr and_() {
    auto e = not_();
    while (word("and")) e = binary("and", std::move(e), not_());
    return e;
  }
  ExprPtr not_() {
    if (word("not")) {
      auto e = make(Expr::Op::unary_not);
      e->args.push_back(not_());
      return e;
    }
    return compare();
  }
  ExprPtr compare() {
    auto e = math1();
    for (;;) {
      std::string o;
      for (const char* c : {"==", "!=", "<=", ">=", "<", ">"})
        if (op(c)) {
          o = c;
          break;
        }
      if (o.empty() && word("in")) o = "in";
      if (o.empty() && t_[p_].text == "not" && t_[p_ + 1].text == "in") p_ += 2, o = "not in";
      if (o.empty()) return e;
      e = binary(o, std::move(e), math1());
    }
  }
  ExprPtr math1() {
    auto e = concat();
    for (;;) {
      if (op("+"))
        e = binary("+", std::move(e), concat());
      else if (op("-"))
        e = binary("-", std::move(e), concat());
      else
        return e;
    }
  }
  ExprPtr concat() {
    auto e = math2();
    while (op("~")) e = binary("~", std::move(e), math2());
    return e;
  }
  ExprPtr math2() {
    auto e = unary();
    for (;;) {
      std::string o;
      for (const char* c : {"//", "*", "/", "%"})
        if (op(c)) {
          o = c;
          break;
        }
      if (o.empty()) return e;
      e = binary(o, std::move(e), unary());
    }
  }
  ExprPtr unary() {
    if (op("-")) {
      auto e = make(Expr::Op::negate);
      e->args.push_back(unary());
      return e;
    }
    if (op("+")) return unary();
    auto e = postfix(primary());
    for (;;) {  // filters and tests bind to what precedes them
      if (op("|")) {
        auto f = make(Expr::Op::filter);
        f->name = name();
        f->args.push_back(std::move(e));
        if (op("(")) arguments(*f);
        e = postfix(std::move(f));
      } else if (word("is")) {
        auto t = make(Expr::Op::test);
        t->negated = word("not");
        t->name = name();
        t->args.push_back(std::move(e));
        if (op("(")) {
          arguments(*t);
        } else if (peek().kind == Token::Kind::string || peek().kind == Token::Kind::integer ||
                   peek().kind == Token::Kind::number) {
          t->args.push_back(primary());  // "is divisibleby 3", "is equalto 'x'"
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
  // After "(": positional and keyword arguments up to ")".
  void arguments(Expr& call) {
    while (!op(")")) {
      if (t_[p_].kind == Token::Kind::name && t_[p_ + 1].text == "=" && t_[p_ + 1].kind == Token::Kind::op) {
        std::string key = name();
        expect("=");
        call.kwargs.emplace_back(std::move(key), expression());
      } else {
        call.args.push_back(expression());
      }
      if (!op(",")) {
        expect(")");
        return;
      }
    }
  }
  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (op(".")) {
        auto a = make(Expr::Op::attr);
        a->name = name();
        a->args.push_back(std::move(e));
        e = std::move(a);
      } else if (op("[")) {
        ExprPtr from, to;
        if (!(peek().kind == Token::Kind::op && peek().text == ":")) from = expression();
        if (op(":")) {
          auto s = make(Expr::Op::slice);
          s->args.push_back(std::move(e));
          if (!(peek().kind == Token::Kind::op && peek().text == "]")) to = expression();
          s->args.push_back(from ? std::move(from) : nullptr);
          s->args.push_back(to ? std::move(to) : nullptr);
          e = std::move(s);
        } else {
          auto i = make(Expr::Op::item);
          i->args.push_back(std::move(e));
          i->args.push_back(std::move(from));
          e = std::move(i);
        }
        expect("]");
      } else if (op("(")) {
        auto c = make(Expr::Op::call);
        c->args.push_back(std::move(e));
        arguments(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprPtr primary() {
    const Token t = t_[p_++];
    auto e = make(Expr::Op::literal);
    switch (t.kind) {
      case Token::Kind::string: {
        std::string s = t.text;  // adjacent strings join, as in Python
        while (t_[p_].kind == Token::Kind::string) s += t_[p_++].text;
        e->value = Value::string(std::move(s));
        return e;
      }
      case Token::Kind::integer:
      case Token::Kind::number:
        try {
          e->value = t.kind == Token::Kind::integer ? Value::integer(std::stoll(t.text))
                                                    : Value::number(std::stod(t.text));
        } catch (const std::out_of_range&) {
          parse_fail(line_, fmt::format("the number {} is out of range", t.text));
        }
        return e;
      case Token::Kind::name:
        if (t.text == "true" || t.text == "True")
          e->value = Value::boolean(true);
        else if (t.text == "false" || t.text == "False")
          e->value = Value::boolean(false);
        else if (t.text == "none" || t.text == "None")
          e->value = Value::none();
        else
          e->op = Expr::Op::name, e->name = t.text;
        return e;
      case Token::Kind::op:
        if (t.text == "(") {
          auto inner = expression();
          expect(")");
          return inner;
        }
        if (t.text == "[") {
          e->op = Expr::Op::list;
          while (!op("]")) {
            e->args.push_back(expression());
            if (!op(",")) {
              expect("]");
              break;
            }
          }
          return e;
        }
        if (t.text == "{") {
          e->op = Expr::Op::dict;
          while (!op("}")) {
            e->args.push_back(expression());
            expect(":");
            e->args.push_back(expression());
            if (!op(",")) {
              expect("}");
              break;
            }
          }
          return e;
        }
        [[fallthrough]];
      default:
        parse_fail(line_, fmt::format("unexpected \"{}\" in an expression", t.text));
    }
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  int line_;
};

ExprPtr parse_expression(const std::string& text, int line) {
  ExprParser p(tokens_of(text, line), line);
  auto e = p.expression();
  if (!p.at_end()) parse_fail(line, fmt::format("unexpected \"{}\" after an expression", p.peek().text));
  return e;
}

// ------------------------------------------------------------------ statements
class StatementParser {
 public:
  explicit StatementParser(std::vector<Segment> s) : s_(std::move(s)) {}

  // Nodes up to a block tag whose first word is in `ends` (consumed; its words in *end_tag).
  Body body(const std::vector<std::string>& ends, std::string* end_tag) {
    Body out;
    while (k_ < s_.size()) {
      const Segment& seg = s_[k_++];
      auto node = std::make_unique<Node>();
      node->line = seg.line;
      switch (seg.kind) {
        case Segment::Kind::comment:
          continue;
        case Segment::Kind::text:
          if (seg.text.empty()) continue;
          node->kind = Node::Kind::text;
          node->text = seg.text;
          break;
        case Segment::Kind::output:
          node->kind = Node::Kind::output;
          node->expr = parse_expression(seg.text, seg.line);
          break;
        case Segment::Kind::block: {
          ExprParser p(tokens_of(seg.text, seg.line), seg.line);
          const std::string word = p.peek().kind == Token::Kind::name ? p.peek().text : "";
          for (const auto& e : ends)
            if (word == e) {
              if (end_tag) *end_tag = seg.text;
              return out;
            }
          statement(p, word, seg, *node);
          break;
        }
      }
      out.push_back(std::move(node));
    }
    if (!ends.empty())
      parse_fail(s_.empty() ? 1 : s_.back().line, fmt::format("missing {{% {} %}}", ends.back()));
    return out;
  }

 private:
  void statement(ExprParser& p, const std::string& word, const Segment& seg, Node& node) {
    p.name();
    std::string end;
    if (word == "if") {
      node.kind = Node::Kind::if_;
      auto condition = p.expression();
      for (;;) {
        Body b = body({"elif", "else", "endif"}, &end);
        node.branches.emplace_back(std::move(condition), std::move(b));
        ExprParser q(tokens_of(end, seg.line), seg.line);
        const std::string w = q.name();
        if (w == "elif") {
          condition = q.expression();
          continue;
        }
        if (w == "else") node.else_body = body({"endif"}, nullptr);
        return;
      }
    }
    if (word == "for") {
      node.kind = Node::Kind::for_;
      node.targets.push_back(p.name());
      while (p.op(",")) node.targets.push_back(p.name());
      if (!p.word("in")) parse_fail(seg.line, "expected \"in\" in a for loop");
      node.expr = p.without_conditional();
      if (p.word("if")) node.condition = p.expression();
      if (!p.at_end()) parse_fail(seg.line, fmt::format("unexpected \"{}\" in a for loop", p.peek().text));
      node.body = body({"else", "endfor"}, &end);
      if (end.find("else") != std::string::npos && end.find("endfor") == std::string::npos)
        node.else_body = body({"endfor"}, nullptr);
      return;
    }
    if (word == "set") {
      node.kind = Node::Kind::set;
      node.targets.push_back(p.name());
      if (p.op(".")) node.targets.push_back(p.name());
      if (!p.op("=")) parse_fail(seg.line, "expected \"=\" in a set (block sets are not supported)");
      node.expr = p.expression();
      if (!p.at_end()) parse_fail(seg.line, fmt::format("unexpected \"{}\" in a set", p.peek().text));
      return;
    }
    if (word == "generation") {  // transformers' marker of assistant text
      node.kind = Node::Kind::generation;
      node.body = body({"endgeneration"}, nullptr);
      return;
    }
    if (word == "break" || word == "continue") {
      node.kind = word == "break" ? Node::Kind::break_ : Node::Kind::continue_;
      return;
    }
    parse_fail(seg.line,
               fmt::format("{{% {} %}} is not supported (if, for, set, break, continue and generation are)",
                           word.empty() ? seg.text : word));
  }
  std::vector<Segment> s_;
  size_t k_ = 0;
};

}  // namespace

Body parse(const std::string& source) {
  StatementParser p(segments_of(source));
  return p.body({}, nullptr);
}

}  // namespace fsdpp::train::text::jinja
