#pragma once
// One head's rows through the rotary embedding, for the attention kernel that rotates q and k as
// it goes (src/models/attention.cpp): rotary_qkv's float32 row loop (src/models/rotary.cpp, built
// without contraction into fused multiply-adds), so the same bits.
#include <cstdint>

namespace fsdpp::models::detail {

// y[t] = rotate(x[t]) for the T rows of D floats, y_ld and x_ld floats apart; cos and sin are
// [T, D], contiguous. With backward, the rotation's gradient instead: x the output's gradient, y
// the input's.
void rotate_head(float* y, int64_t y_ld, const float* x, int64_t x_ld, const float* cos, const float* sin, int64_t T,
                 int64_t D, bool backward);

}  // namespace fsdpp::models::detail
