// The weight quantizers' driver: rows of a QuantSource in chunks over the engine's pool, each row
// widened to fp32 once and handed to its row kernel (quantize_rows.cpp).
#include "quantize.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>

#include "moe_engine.h"  // global_pool()
#include "thread_pool.h"

namespace hetmoe {
namespace {

constexpr int64_t kRowsPerItem = 16;

const QuantRowKernels* kernels_for(const QuantSource& src) {
  return src.avx512 ? quant_row_kernels_avx512() : quant_row_kernels();
}

// Runs row(w, global_row) for every row, w its fp32 values; a row holding NaN/Inf is counted and
// zero(global_row) clears its outputs instead.
template <class Row, class Zero>
QuantResult for_rows(const QuantSource& src, Row row, Zero zero) {
  const int64_t rows = int64_t(src.parts.size()) * src.n;
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  const QuantRowKernels* kr = kernels_for(src);
  const int64_t elem = src.dtype == kSrcF32 ? 4 : 2;
  std::atomic<int64_t> bad{0};
  std::mutex mu;
  int64_t first_bad = -1;
  auto job = std::make_shared<ForJob>(int(items), [&](int item) {
    thread_local std::vector<float> w;
    if (int64_t(w.size()) < src.k) w.resize(size_t(src.k));
    const int64_t r1 = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t r = item * kRowsPerItem; r < r1; ++r) {
      const uint8_t* base = static_cast<const uint8_t*>(src.parts[size_t(r / src.n)]);
      const int nonfinite = kr->load_row(base + (r % src.n) * src.row_stride * elem, src.dtype, src.k, w.data());
      if (nonfinite) {
        bad += nonfinite;
        std::lock_guard<std::mutex> lock(mu);
        if (first_bad < 0 || r < first_bad) first_bad = r;
        zero(r);
      } else {
        row(w.data(), r);
      }
    }
  });
  global_pool()->submit(job);
  job->wait();
  return {bad.load(), first_bad};
}

}  // namespace

QuantResult quantize_int4(const QuantSource& src, int group, bool asym, int min_zero, bool f16_scales,
                          uint8_t* codes, uint16_t* scales, uint8_t* zeros) {
  const int64_t k = src.k, groups = k / group;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(
      src,
      [&](const float* w, int64_t r) {
        kr->int4(w, k, group, asym, min_zero, f16_scales, codes + r * (k / 2), scales + r * groups, asym ? zeros + r * groups : nullptr);
      },
      [&](int64_t r) {
        std::memset(codes + r * (k / 2), 0, size_t(k / 2));
        std::memset(scales + r * groups, 0, size_t(groups) * 2);
        if (asym) std::memset(zeros + r * groups, 0, size_t(groups));
      });
}

QuantResult quantize_int8(const QuantSource& src, int8_t* codes, float* scales) {
  const int64_t k = src.k;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(
      src, [&](const float* w, int64_t r) { kr->int8(w, k, codes + r * k, scales + r); },
      [&](int64_t r) {
        std::memset(codes + r * k, 0, size_t(k));
        scales[r] = 0.0f;
      });
}

QuantResult quantize_fp8_channel(const QuantSource& src, uint8_t* codes, float* scales) {
  const int64_t k = src.k;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(
      src, [&](const float* w, int64_t r) { kr->fp8_channel(w, k, codes + r * k, scales + r); },
      [&](int64_t r) {
        std::memset(codes + r * k, 0, size_t(k));
        scales[r] = 0.0f;
      });
}

QuantResult quantize_mxfp4(const QuantSource& src, uint8_t* blocks, uint8_t* scales) {
  const int64_t k = src.k;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(
      src, [&](const float* w, int64_t r) { kr->mxfp4(w, k, blocks + r * (k / 2), scales + r * (k / 32)); },
      [&](int64_t r) {
        std::memset(blocks + r * (k / 2), 0, size_t(k / 2));
        std::memset(scales + r * (k / 32), 0, size_t(k / 32));
      });
}

QuantResult quantize_q4_0(const QuantSource& src, uint8_t* out) {
  const int64_t k = src.k, row_bytes = k / 32 * 18;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(
      src, [&](const float* w, int64_t r) { kr->q4_0(w, k, out + r * row_bytes); },
      [&](int64_t r) { std::memset(out + r * row_bytes, 0, size_t(row_bytes)); });
}

QuantResult quantize_q8_0(const QuantSource& src, uint8_t* out) {
  const int64_t k = src.k, row_bytes = k / 32 * 34;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(
      src, [&](const float* w, int64_t r) { kr->q8_0(w, k, out + r * row_bytes); },
      [&](int64_t r) { std::memset(out + r * row_bytes, 0, size_t(row_bytes)); });
}

}  // namespace hetmoe
