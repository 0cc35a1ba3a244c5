// The weight quantizers' driver: rows of a QuantSource in chunks over the engine's pool, each row
// widened to fp32 once and handed to its row kernel (quantize_rows.cpp).
#include "quantize.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>

#include "method_traits.h"  // the GGUF block structs
#include "moe_engine.h"  // global_pool()
#include "thread_pool.h"

namespace hetmoe {
namespace {

constexpr int64_t kRowsPerItem = 16;

const QuantRowKernels* kernels_for(const QuantSource& src) {
  return src.avx512 ? quant_row_kernels_avx512() : quant_row_kernels();
}

// One output of a quantizer: a row's bytes start at p + row * row_bytes.
struct Output {
  void* p;
  int64_t row_bytes;
};

// Runs row(w, global_row) for every row, w its fp32 values; a row holding NaN/Inf is counted and
// its bytes of every output (absent ones: p null) are zeroed instead.
template <class Row>
QuantResult for_rows(const QuantSource& src, std::initializer_list<Output> outputs, Row row) {
  const std::vector<Output> outs(outputs);
  const int64_t rows = int64_t(src.parts.size()) * src.n;
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  const QuantRowKernels* kr = kernels_for(src);
  const int64_t elem = src.dtype == kSrcF32 ? 4 : src.dtype == kSrcF8E4M3 ? 1 : 2;
  std::atomic<int64_t> bad{0};
  std::mutex mu;
  int64_t first_bad = -1;
  auto job = std::make_shared<ForJob>(int(items), [&](int item) {
    thread_local std::vector<float> w;
    if (int64_t(w.size()) < src.k) w.resize(size_t(src.k));
    const int64_t r1 = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t r = item * kRowsPerItem; r < r1; ++r) {
      const size_t part = size_t(r / src.n);
      const int64_t in_part = r % src.n;
      const uint8_t* at = static_cast<const uint8_t*>(src.parts[part]) + in_part * src.row_stride * elem;
      const int nonfinite =
          src.dtype == kSrcF8E4M3
              ? kr->load_row_fp8(at, src.scale_parts[part] + in_part / src.scale_block_rows * src.scale_row_stride,
                                 src.scale_block_cols, src.k, w.data())
              : kr->load_row(at, src.dtype, src.k, w.data());
      if (nonfinite) {
        bad += nonfinite;
        std::lock_guard<std::mutex> lock(mu);
        if (first_bad < 0 || r < first_bad) first_bad = r;
        for (const Output& o : outs)
          if (o.p) std::memset(static_cast<uint8_t*>(o.p) + r * o.row_bytes, 0, size_t(o.row_bytes));
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
  return for_rows(src, {{codes, k / 2}, {scales, groups * 2}, {asym ? zeros : nullptr, groups}},
                  [&](const float* w, int64_t r) {
                    kr->int4(w, k, group, asym, min_zero, f16_scales, codes + r * (k / 2), scales + r * groups,
                             asym ? zeros + r * groups : nullptr);
                  });
}

QuantResult quantize_int8(const QuantSource& src, int8_t* codes, float* scales) {
  const int64_t k = src.k;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(src, {{codes, k}, {scales, 4}},
                  [&](const float* w, int64_t r) { kr->int8(w, k, codes + r * k, scales + r); });
}

QuantResult quantize_fp8_channel(const QuantSource& src, uint8_t* codes, float* scales) {
  const int64_t k = src.k;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(src, {{codes, k}, {scales, 4}},
                  [&](const float* w, int64_t r) { kr->fp8_channel(w, k, codes + r * k, scales + r); });
}

QuantResult quantize_mxfp4(const QuantSource& src, uint8_t* blocks, uint8_t* scales) {
  const int64_t k = src.k;
  const QuantRowKernels* kr = kernels_for(src);
  return for_rows(src, {{blocks, k / 2}, {scales, k / 32}}, [&](const float* w, int64_t r) {
    kr->mxfp4(w, k, blocks + r * (k / 2), scales + r * (k / 32));
  });
}

namespace {

using GGUFRowKernel = void (*QuantRowKernels::*)(const float*, int64_t, uint8_t*);
struct GGUFKind {
  const char* name;
  int64_t block_elements, block_bytes;
  GGUFRowKernel kernel;
};
constexpr GGUFKind kGGUFKinds[] = {  // the blocks' sizes as method_traits.h checks them against ggml's
    {"q4_0", 32, sizeof(BlockQ4_0), &QuantRowKernels::q4_0},
    {"q8_0", 32, sizeof(BlockQ8_0), &QuantRowKernels::q8_0},
    {"q4_k", 256, sizeof(BlockQ4K), &QuantRowKernels::q4_k},
    {"q5_k", 256, sizeof(BlockQ5K), &QuantRowKernels::q5_k},
    {"q6_k", 256, sizeof(BlockQ6K), &QuantRowKernels::q6_k},
    {"iq4_nl", 32, sizeof(BlockIQ4NL), &QuantRowKernels::iq4_nl},
    {"iq4_xs", 256, sizeof(BlockIQ4XS), &QuantRowKernels::iq4_xs},
};

const GGUFKind* find_gguf_kind(const char* kind) {
  for (const GGUFKind& t : kGGUFKinds)
    if (std::strcmp(t.name, kind) == 0) return &t;
  return nullptr;
}

}  // namespace

std::vector<std::string> gguf_quantize_kinds() {
  std::vector<std::string> out;
  for (const GGUFKind& t : kGGUFKinds) out.emplace_back(t.name);
  return out;
}

int64_t gguf_block_elements(const char* kind) {
  const GGUFKind* t = find_gguf_kind(kind);
  return t ? t->block_elements : 0;
}

QuantResult quantize_gguf(const QuantSource& src, const char* kind, uint8_t* out) {
  const GGUFKind* t = find_gguf_kind(kind);
  if (!t) return {-1, -1};
  const int64_t k = src.k, row_bytes = k / t->block_elements * t->block_bytes;
  const QuantRowKernels* kr = kernels_for(src);
  const GGUFRowKernel kernel = t->kernel;
  return for_rows(src, {{out, row_bytes}}, [&](const float* w, int64_t r) { (kr->*kernel)(w, k, out + r * row_bytes); });
}

}  // namespace hetmoe
