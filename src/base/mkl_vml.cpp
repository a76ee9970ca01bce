#include "fsdpp/base/mkl_vml.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/acos.h>
#include <ATen/ops/asin.h>
#include <ATen/ops/atan.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/erf.h>
#include <ATen/ops/erfc.h>
#include <ATen/ops/erfinv.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log.h>
#include <ATen/ops/log10.h>
#include <ATen/ops/log2.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/tan.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/trunc.h>

#include <mutex>

namespace fsdpp {

void detail::call_mkl_vml_functions() {
  // The operators of ATen/cpu/vml.h's IMPLEMENT_VML_MKL list, each on one element (0.5 is in every
  // one's domain) of each type it is declared for.
  using Op = at::Tensor (*)(const at::Tensor&);
  static constexpr Op kOps[] = {at::acos,   at::asin, at::atan, at::cos,   at::erf,  at::erfc,
                                at::erfinv, at::exp,  at::log,  at::log10, at::log2, at::sin,
                                at::sqrt,   at::tan,  at::tanh, at::trunc};
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    const auto x = at::full({1}, 0.5, at::TensorOptions().dtype(dtype).device(at::kCPU));
    for (const Op op : kOps) op(x);
  }
}

void resolve_mkl_vml_kernels() {
  static std::once_flag once;
  std::call_once(once, detail::call_mkl_vml_functions);
}

}  // namespace fsdpp
