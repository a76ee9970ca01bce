// The recipe's precision section: dtypes by name, overrides by glob, and the MixedPrecisionPolicy
// fully_shard gets (docs/recipes.md, "precision").
#include <type_traits>

#include "recipe_reader.hpp"

namespace fsdpp::train::recipe_detail {

namespace {

fsdp::MixedPrecisionPolicy precision_policy(const PrecisionOptions& p) {
  fsdp::MixedPrecisionPolicy policy;
  if (p.param_dtype != at::kFloat) policy.param_dtype = p.param_dtype;  // float32: keep each parameter's own
  policy.reduce_dtype = p.reduce_dtype;
  if (p.overrides.empty()) return policy;
  // The first override that matches and sets the dtype in question.
  auto pick = [overrides = p.overrides](auto member) {
    return [overrides, member](const std::string& name, const at::Tensor&) {
      for (const auto& o : overrides)
        if ((o.*member) && fsdp::glob_match(o.match, name)) return o.*member;
      return std::remove_cvref_t<decltype(overrides.front().*member)>();
    };
  };
  policy.param_dtype_override = pick(&DtypeOverride::param_dtype);
  policy.grad_dtype = pick(&DtypeOverride::grad_dtype);
  return policy;
}

}  // namespace

void read_precision(Reader& top, Recipe& rc, [[maybe_unused]] const std::string& base_dir) {
  Reader pr = top.section("precision");
  std::string param_dtype = "float32", reduce_dtype = "float32";
  pr.string("param_dtype", param_dtype, kDtypes);
  rc.precision.param_dtype = dtype_named(param_dtype);
  // null: PyTorch's reduce_dtype=None (fully_shard.md, "Gradient dtypes")
  if (const json* r = pr.find("reduce_dtype"); r && r->is_null()) {
    rc.precision.reduce_dtype = std::nullopt;
  } else {
    pr.string("reduce_dtype", reduce_dtype, kDtypes);
    rc.precision.reduce_dtype = dtype_named(reduce_dtype);
  }
  if (const json* ov = pr.find("overrides")) {
    if (!ov->is_array()) {
      pr.fail("overrides", "must be an array of {\"match\": ..., \"param_dtype\": ..., \"grad_dtype\": ...}");
    } else {
      for (size_t i = 0; i < ov->size(); ++i) {
        Reader o = pr.element(&(*ov)[i], fmt::format("overrides[{}]", i));  // own hints
        DtypeOverride d;
        o.string("match", d.match);
        std::string pd, gd;
        o.string("param_dtype", pd, kDtypes);
        if (d.match.empty()) o.fail("match", "missing: a glob on parameter names, for example \"*norm*\"");
        if (!o.find("param_dtype") && !o.find("grad_dtype")) o.fail("", "needs param_dtype or grad_dtype");
        if (!pd.empty()) d.param_dtype = dtype_named(pd);
        // null: an explicit grad_dtype of none, PyTorch's `param.grad_dtype = None`
        if (const json* g = o.find("grad_dtype"); g && g->is_null()) {
          d.grad_dtype = fsdp::GradDtype::none();
        } else {
          o.string("grad_dtype", gd, kDtypes);
          if (!gd.empty()) d.grad_dtype = dtype_named(gd);
        }
        rc.precision.overrides.push_back(d);
      }
    }
  }
  rc.precision.policy = precision_policy(rc.precision);
}

}  // namespace fsdpp::train::recipe_detail
