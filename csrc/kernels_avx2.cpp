// AVX2 + FMA + F16C kernels: the baseline every supported x86-64 CPU runs.
// Compiled with -mavx2 -mfma -mf16c (setup.py); selected at run time only where CPUID says so.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "kquant_scales.h"
#include "method_traits.h"

namespace hetmoe {
namespace {

constexpr int LANES = 8;
using V = __m256;
#define ISA_NAME "avx2"
#define GEMM_RB 3  // 3 rows x 4 tokens: 12 accumulators + 3 weights + 1 activation = 16 registers
#define GEMM_TB 4

inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline float vhsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// x rounded to the nearest bf16 (ties to even), kept as fp32; for finite values.
inline V vround_bf16(V x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline V vload_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// e4m3 -> fp16 by moving its bits (sign to bit 15, exponent and mantissa to bits 13..7): the fp16
// is the e4m3 value times 2^-8 exactly, subnormals included; F16C widens it to fp32. Sign-extending
// the byte puts the sign in bits 8..15, so one shift by 7 places everything and one mask clears
// the copy of the sign that lands in bit 14.
inline V vload_fp8(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
}
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for integer-valued n in the normal range, built in the exponent field.
inline V vexp2i(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// Pairwise int16 products summed into 8 int32 lanes: even x xe + odd x xo.
inline __m256i idot(__m256i even, __m256i xe, __m256i odd, __m256i xo) {
  return _mm256_add_epi32(_mm256_madd_epi16(even, xe), _mm256_madd_epi16(odd, xo));
}

#include "kernels_common.inc"

}  // namespace

const KernelTable* avx2_kernels() { return &kTable; }

}  // namespace hetmoe
