#pragma once
// MixedPrecisionPolicy: in which dtypes a sharded unit computes, reduces and accumulates.
//
//   param_dtype      dtype of the unsharded parameters, so of the all-gather and of compute. The
//                    sharded parameters, which the optimizer sees, keep their own dtype.
//   reduce_dtype     dtype of the reduce-scatter. Default: the widest accumulation dtype (below) of
//                    the unit's parameters.
//   output_dtype     floating-point outputs of forward are cast to it.
//   cast_forward_inputs  floating-point tensor inputs of forward are cast to param_dtype.
//   param_dtype_override(name, tensor)  per parameter, a dtype that replaces param_dtype (for
//                    example float32 for "*.router.gate.weight" and "*norm*" inside a bfloat16
//                    model), or nullopt for the default.
//   grad_dtype(name, tensor)  per parameter, an explicit grad_dtype as PyTorch 2.15's
//                    `param.grad_dtype`: a dtype, GradDtype::none() (gradients keep whatever dtype
//                    autograd gives them), or nullopt (unset: the parameter's own dtype). As in 2.15
//                    (FSDPParam.unsharded_grad_dtype and sharded_grad_dtype):
//                      - the unsharded gradient, in the unsharded parameter's .grad, accumulates
//                        across no-sync microbatches in reduce_dtype when set, else in the explicit
//                        grad_dtype (none: as autograd gives it), else in the parameter's own dtype
//                        (not its compute dtype: bfloat16 compute of float32 parameters accumulates
//                        in float32);
//                      - the sharded gradient, on the sharded parameter, is in the explicit
//                        grad_dtype (none: the reduce dtype as it comes), else the parameter's own.
//                    docs/fully_shard.md ("Gradient dtypes") has the table.
//
// Both callables see the parameter's name in the unwrapped model (from the module fully_shard is
// called on) and its original tensor. They must give the same answer on every rank; fully_shard
// checks that and fails naming the ranks that differ.

#include <c10/core/ScalarType.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace fsdpp::fsdp {

using DtypeFn = std::function<std::optional<at::ScalarType>(const std::string& name, const at::Tensor&)>;

// An explicit grad_dtype: a dtype, or none (`dtype` empty).
struct GradDtype {
  GradDtype(at::ScalarType d) : dtype(d) {}  // NOLINT(google-explicit-constructor): a dtype is a GradDtype
  static GradDtype none() { return GradDtype(); }
  std::optional<at::ScalarType> dtype;

 private:
  GradDtype() = default;
};
// A DtypeFn converts: its dtypes are explicit grad_dtypes, its nullopt unset.
using GradDtypeFn = std::function<std::optional<GradDtype>(const std::string& name, const at::Tensor&)>;

struct MixedPrecisionPolicy {
  std::optional<at::ScalarType> param_dtype;
  std::optional<at::ScalarType> reduce_dtype;
  std::optional<at::ScalarType> output_dtype;
  bool cast_forward_inputs = true;
  DtypeFn param_dtype_override;
  GradDtypeFn grad_dtype;
};

// A DtypeFn that returns `dtype` for parameters whose name matches any of the glob patterns
// ('*' matches any run of characters, including dots), for example
// dtype_for({"*.router.gate.weight", "*norm*"}, at::kFloat).
DtypeFn dtype_for(std::vector<std::string> patterns, at::ScalarType dtype);

bool glob_match(const std::string& pattern, const std::string& text);

}  // namespace fsdpp::fsdp
