#include "norms.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "engine_common.h"

namespace hetmoe {
namespace {

using engine::bf16_to_f32;

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

template <typename T, typename Load, typename Store>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t batch, int64_t heads, int64_t tokens,
               int64_t dim, bool cos_batched, Load load, Store store) {
  const int64_t half = dim / 2;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < tokens; ++t) {
        const size_t row = ((size_t(b) * heads + h) * tokens + t) * dim;
        const size_t cs = ((cos_batched ? size_t(b) : 0) * tokens + t) * dim;
        for (int64_t j = 0; j < dim; ++j) {
          const float rot = j < half ? -load(x[row + j + half]) : load(x[row + j - half]);
          out[row + j] = store(store(load(x[row + j]) * load(cos[cs + j])) + store(rot * load(sin[cs + j])));
        }
      }
}

void rope(const void* x, const void* cos, const void* sin, void* out, int dtype, int64_t batch, int64_t heads,
          int64_t tokens, int64_t dim, bool cos_batched) {
  if (dtype == kBF16Data) {
    // store() rounds to bf16 and returns the rounded value as float, so each operation rounds once
    auto load = [](float v) { return v; };
    std::vector<float> xf, cf, sf;  // widened once: the rows are short
    const size_t n = size_t(batch) * heads * tokens * dim, nc = size_t(cos_batched ? batch : 1) * tokens * dim;
    xf.resize(n);
    cf.resize(nc);
    sf.resize(nc);
    for (size_t i = 0; i < n; ++i) xf[i] = bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
    for (size_t i = 0; i < nc; ++i) {
      cf[i] = bf16_to_f32(static_cast<const uint16_t*>(cos)[i]);
      sf[i] = bf16_to_f32(static_cast<const uint16_t*>(sin)[i]);
    }
    std::vector<float> of(n);
    rope_rows(xf.data(), cf.data(), sf.data(), of.data(), batch, heads, tokens, dim, cos_batched, load,
              [](float v) { return round_bf16(v); });
    uint16_t* o = static_cast<uint16_t*>(out);
    for (size_t i = 0; i < n; ++i) o[i] = engine::f32_to_bf16(of[i]);  // exact: already bf16 values
  } else {
    rope_rows(static_cast<const float*>(x), static_cast<const float*>(cos), static_cast<const float*>(sin),
              static_cast<float*>(out), batch, heads, tokens, dim, cos_batched, [](float v) { return v; },
              [](float v) { return v; });
  }
}

}  // namespace hetmoe
