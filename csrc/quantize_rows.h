// The per-row quantizers (quantize_rows.cpp, compiled with AVX2 + F16C and -ffp-contract=off).
// Plain data only: this header is shared by that unit and the baseline code (quantize.cpp).
#pragma once
#include <cstdint>

namespace hetmoe {

struct QuantRowKernels {
  // dst[i] = float(src[i]) for one row of k values (dtype: quantize.h SourceDtype); returns how
  // many of them are NaN/Inf.
  int (*load_row)(const void* src, int dtype, int64_t k, float* dst);
  // dst[i] = float(codes[i]) * scales[i / block_cols] for one row of k e4m3fn codes (the fp8
  // codecs' dequantize: one fp32 product); returns how many results are NaN/Inf.
  int (*load_row_fp8)(const uint8_t* codes, const float* scales, int64_t block_cols, int64_t k, float* dst);
  // One fp32 row each, outputs as quantize.h describes them for that row.
  void (*int4)(const float* w, int64_t k, int group, bool asym, int min_zero, bool f16_scales, uint8_t* codes,
               uint16_t* scales, uint8_t* zeros);
  void (*int8)(const float* w, int64_t k, int8_t* codes, float* scale);
  void (*fp8_channel)(const float* w, int64_t k, uint8_t* codes, float* scale);
  void (*mxfp4)(const float* w, int64_t k, uint8_t* blocks, uint8_t* scales);
  void (*q4_0)(const float* w, int64_t k, uint8_t* out);
  void (*q8_0)(const float* w, int64_t k, uint8_t* out);
  void (*q4_k)(const float* w, int64_t k, uint8_t* out);
  void (*q5_k)(const float* w, int64_t k, uint8_t* out);
  void (*q6_k)(const float* w, int64_t k, uint8_t* out);
  void (*iq4_nl)(const float* w, int64_t k, uint8_t* out);
  void (*iq4_xs)(const float* w, int64_t k, uint8_t* out);
};

const QuantRowKernels* quant_row_kernels();
// The same kernels, symmetric int4 two groups a pass in 512-bit registers (quantize_rows_avx512.cpp):
// the same bytes; only where the CPU has the AVX-512 unit's features (cpu_features.h can_avx512).
const QuantRowKernels* quant_row_kernels_avx512();

}  // namespace hetmoe
