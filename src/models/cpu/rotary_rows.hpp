#pragma once
// rotary_qkv's pieces for the attention kernel that rotates q and k as it goes
// (src/models/cpu/attention.cpp): its shape checks, and one head's rows through its float32 row loop
// (src/models/cpu/rotary.cpp, built without contraction into fused multiply-adds), so the same bits.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdpp::models::detail {

// rotary_qkv's shape checks: qkv [B, T, 3, H, D] with an even D, cos and sin [T, D]; throws
// c10::Error naming what is wrong.
void check_rotary_shapes(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin);

// y[t] = rotate(x[t]) for the T rows of D floats, y_ld and x_ld floats apart; cos and sin are
// [T, D], contiguous. With backward, the rotation's gradient instead: x the output's gradient, y
// the input's.
void rotate_head(float* y, int64_t y_ld, const float* x, int64_t x_ld, const float* cos, const float* sin,
                 int64_t T, int64_t D, bool backward);

}  // namespace fsdpp::models::detail
