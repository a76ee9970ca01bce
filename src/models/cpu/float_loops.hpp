#pragma once
// Loops shared by the model's CPU kernels (kernels.cpp, attention.cpp): written so that gcc's -O3
// vectoriser takes them without reassociating anything.
#include <bit>
#include <cstdint>

namespace fsdpp::models::loops {

constexpr int kLanes = 16;

// The kernels' work handed to one intra-op thread at a time: at least this many elements.
constexpr int64_t kElementsPerTask = 16384;

// Rows of `row_elements` elements per such range (at least one; empty rows count as one element).
inline int64_t rows_per_task(int64_t row_elements) {
  const int64_t rows = kElementsPerTask / (row_elements > 1 ? row_elements : 1);
  return rows > 1 ? rows : 1;
}

// exp(x) for float x: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a degree-7 polynomial (Cephes'
// expf coefficients), 2^n put into the exponent bits. Within 2 ulps of the correctly rounded value
// over [-87, 88], the range clamped to (below it the result is 0 to float precision for our uses:
// sigmoid, silu, softmax); NaN stays NaN. Branch-free, so the loops calling it vectorise.
inline float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const float t = x * 1.44269504088896341f + kShift;
  const float n = t - kShift;
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShift);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * (r * r) + r + 1.0f;
  return er * std::bit_cast<float>((ni + 127) << 23);
}

// sum of x[i] * y[i], in kLanes partial sums (vectorisable without reassociating anything).
inline float dot(const float* x, const float* y, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += x[i + k] * y[i + k];
  float s = 0.0f;
  for (; i < n; ++i) s += x[i] * y[i];
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  return s;
}

}  // namespace fsdpp::models::loops
