// AVX-512 (F, BW, VL, VNNI) kernels: 16-lane fp32 for bf16/fp8 and the GEMM panels, VPDPWSSD for
// the integer dot products. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni plus the
// AVX2 flags (setup.py); selected at run time only where CPUID reports all of them and the OS
// saves ZMM state.
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

constexpr int LANES = 16;
using V = __m512;
#define ISA_NAME "avx512"
#define GEMM_RB 4  // 4 rows x 6 tokens: 24 accumulators + 4 weights + 1 activation of 32 registers
#define GEMM_TB 6

inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline float vhsum(V v) { return _mm512_reduce_add_ps(v); }
// x rounded to the nearest bf16 (ties to even), kept as fp32; for finite values.
inline V vround_bf16(V x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline V vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
// e4m3 -> fp16 by moving bits (see the AVX2 unit), then widen 16 halves to fp32.
inline V vload_fp8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
}
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vexp2i(V n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// VNNI: two fused multiply-accumulates of int16 pairs into 8 int32 lanes.
inline __m256i idot(__m256i even, __m256i xe, __m256i odd, __m256i xo) {
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), even, xe), odd, xo);
}

#include "kernels_common.inc"

}  // namespace

const KernelTable* avx512_kernels() { return &kTable; }

}  // namespace hetmoe
