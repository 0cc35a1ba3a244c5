#include "norms.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "engine_common.h"

namespace hetmoe {
namespace {

inline float bf16_to_f32(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float round_bf16(float f) { return bf16_to_f32(engine::f32_to_bf16(f)); }

}  // namespace

void rms_norm(const void* x, const void* w, void* y, int dtype, int64_t rows, int64_t cols, float eps, int mode) {
  std::vector<float> row(cols), weight(cols);
  const bool bf16 = dtype == kBF16Data;
  for (int64_t c = 0; c < cols; ++c)
    weight[c] = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(w)[c]) : static_cast<const float*>(w)[c];
  if (mode == kNormOffsetScale)
    for (float& v : weight) v += 1.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const size_t base = size_t(r) * cols;
    for (int64_t c = 0; c < cols; ++c)
      row[c] = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[base + c]) : static_cast<const float*>(x)[base + c];
    // Sum of squares in eight interleaved partial sums (vectorizes; torch also sums in parts).
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8)
      for (int j = 0; j < 8; ++j) part[j] += row[c + j] * row[c + j];
    for (; c < cols; ++c) part[0] += row[c] * row[c];
    const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const float inv = 1.0f / std::sqrt(sum / float(cols) + eps);
    if (bf16) {
      uint16_t* out = static_cast<uint16_t*>(y) + base;
      if (mode == kNormCastThenScale) {
        for (c = 0; c < cols; ++c) out[c] = engine::f32_to_bf16(weight[c] * round_bf16(row[c] * inv));
      } else {
        for (c = 0; c < cols; ++c) out[c] = engine::f32_to_bf16(weight[c] * (row[c] * inv));
      }
    } else {
      float* out = static_cast<float*>(y) + base;
      for (c = 0; c < cols; ++c) out[c] = weight[c] * (row[c] * inv);
    }
  }
}

}  // namespace hetmoe
