// Weight quantizers in the engine: full-precision rows -> a codec's stored bytes, on the thread pool.
//
// Each one reproduces a Python codec of hetmoe/formats bit for bit (the codecs stay the reference;
// tests/test_engine_quantize.py holds the two equal): the same float32 operations in the same order,
// no contraction into FMAs (quantize_rows.cpp is compiled with -ffp-contract=off), squared errors
// summed in fp32 in the lane order int_scales.lane_sum defines. The row kernels are AVX2 code
// (quantize_rows.cpp), or the same with 512-bit symmetric int4 (quantize_rows_avx512.cpp, where
// QuantSource::avx512 asks for it); callers check cpu_features() first.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "quantize_rows.h"

namespace hetmoe {

enum SourceDtype : int { kSrcF32 = 0, kSrcBF16 = 1, kSrcF16 = 2, kSrcF8E4M3 = 3 };

// The rows to quantize: `parts` base pointers (experts), each `n` rows of `k` values of `dtype`,
// rows `row_stride` elements apart. Outputs are laid out part after part, row after row.
// kSrcF8E4M3 (fp8 checkpoints: formats/fp8.py, fp8_channel.py): a value is its e4m3fn code times
// an fp32 scale, one scale per block of scale_block_rows x scale_block_cols values (DeepSeek-V3's
// 128 x 128; per channel: 1 x k), part p's scales at scale_parts[p], scale_row_stride scales from
// one row of blocks to the next.
struct QuantSource {
  std::vector<const void*> parts;
  int64_t n = 0, k = 0, row_stride = 0;
  int dtype = kSrcBF16;
  bool avx512 = false;  // run quant_row_kernels_avx512 (the caller checked the CPU has it)
  std::vector<const float*> scale_parts;
  int64_t scale_block_rows = 1, scale_block_cols = 1, scale_row_stride = 0;
};

// Rows holding NaN/Inf get all-zero outputs and are counted; the caller raises the error.
struct QuantResult {
  int64_t nonfinite = 0;       // NaN/Inf values seen
  int64_t first_bad_row = -1;  // global row index (part * n + row) of the first row with one
};

// int4 / int4-asym / gptq (int_scales.symmetric_int4 / asymmetric_int4): codes two a byte (low
// nibble = even k, stored code = value + 8 or q), scales [rows, k/group] as bf16 (or fp16, gptq's)
// bits, zeros uint8 [rows, k/group] (asym only). group: a positive multiple of 8 dividing k.
QuantResult quantize_int4(const QuantSource& src, int group, bool asym, int min_zero, bool f16_scales,
                          uint8_t* codes, uint16_t* scales, uint8_t* zeros);
// int8 (int_scales.symmetric_int8_rows): int8 codes [rows, k], fp32 scale per row.
QuantResult quantize_int8(const QuantSource& src, int8_t* codes, float* scales);
// fp8-channel (formats/fp8_channel.py): e4m3fn codes [rows, k], fp32 scale per row.
QuantResult quantize_fp8_channel(const QuantSource& src, uint8_t* codes, float* scales);
// mxfp4 (formats/mxfp4.py): E2M1 codes [rows, k/2] low nibble first, e8m0 exponents [rows, k/32].
QuantResult quantize_mxfp4(const QuantSource& src, uint8_t* blocks, uint8_t* scales);
// GGUF block types (formats/gguf: legacy.py encode_q4_0 / encode_q8_0, kquantize.py, nonlinear.py
// encode_iq4_*): rows of blocks, `kind` one of q4_0, q8_0, q4_k, q5_k, q6_k, iq4_nl, iq4_xs; k a
// multiple of the type's block (32, or 256 for the K-quants and IQ4_XS). Unknown kind: nonfinite -1.
QuantResult quantize_gguf(const QuantSource& src, const char* kind, uint8_t* out);
// The kinds quantize_gguf writes (its one table), and a kind's block of weights (0: not one of them).
std::vector<std::string> gguf_quantize_kinds();
int64_t gguf_block_elements(const char* kind);


}  // namespace hetmoe
