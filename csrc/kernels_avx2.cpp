// AVX2 + FMA + F16C kernels: the baseline every supported x86-64 CPU runs.
// Compiled with -mavx2 -mfma -mf16c (setup.py); selected at run time only where CPUID says so.
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

namespace hetmoe {
namespace {

constexpr int LANES = 8;
using V = __m256;
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
inline float bf16_scalar(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline V vload_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// exp(x) to ~1 ulp over the range SiLU needs: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2].
inline V vexp(V x) {
  x = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.f)), vset1(88.f));
  V n = _mm256_round_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return vmul(p, _mm256_castsi256_ps(e));
}

void widen_int8_row(const int8_t* w, int K, float s, float* dst) {
  const V sv = vset1(s);
  for (int k = 0; k < K; k += 8) {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)));
    vstore(dst + k, vmul(_mm256_cvtepi32_ps(v), sv));
  }
}

// 32 codes of a block in natural order: interleave low (even k) and high (odd k) nibbles.
inline __m256i int4_block_natural(const uint8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

void widen_int4_row(const uint8_t* w, const uint16_t* s, int group, int K, float* dst) {
  const int shift = __builtin_ctz(unsigned(group / 32));
  const __m256i eight = _mm256_set1_epi32(8);
  for (int k = 0; k < K; k += 32) {
    const V sv = vset1(bf16_scalar(s[(k >> 5) >> shift]));
    __m256i c = int4_block_natural(w + k / 2);
    for (int j = 0; j < 4; ++j) {
      __m128i part = j == 0 ? _mm256_castsi256_si128(c)
                   : j == 1 ? _mm_srli_si128(_mm256_castsi256_si128(c), 8)
                   : j == 2 ? _mm256_extracti128_si256(c, 1)
                            : _mm_srli_si128(_mm256_extracti128_si256(c, 1), 8);
      __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(part), eight);
      vstore(dst + k + 8 * j, vmul(_mm256_cvtepi32_ps(v), sv));
    }
  }
}

inline V bcast_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi16(static_cast<short>(*p)), 16));
}

// One block of 32 for T tokens: weights widened to int16 as (even half, odd half) or
// (first 16, last 16), multiplied pairwise with pmaddwd against the token's int16 block.
template <int T>
inline void block_step(__m256i w0, __m256i w1, V sw, const Act* x, int b, V* acc) {
  for (int t = 0; t < T; ++t) {
    const __m256i* xq = reinterpret_cast<const __m256i*>(x[t].q + b * 32);
    __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xq)),
                                   _mm256_madd_epi16(w1, _mm256_loadu_si256(xq + 1)));
    acc[t] = vfma(_mm256_cvtepi32_ps(dot), vmul(sw, vset1(x[t].d[b])), acc[t]);
  }
}

// ---- int8 weights x int16 activations ----
template <int T>
void gemv_int8_t(const Proj& p, int e, int n0, int n1, const Act* x, float* y, int ldy) {
  const int NB = p.k / kActBlock;
  const V one = vset1(1.f);
  for (int n = n0; n < n1; ++n) {
    const int8_t* w = reinterpret_cast<const int8_t*>(p.w + e * p.w_estride + int64_t(n) * p.w_rstride);
    const float s = *reinterpret_cast<const float*>(p.s + e * p.s_estride + int64_t(n) * p.s_rstride);
    V acc0[T], acc1[T];  // even and odd blocks: independent FMA chains
    for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = vzero();
    int b = 0;
    for (; b + 2 <= NB; b += 2) {
      const __m128i* wb = reinterpret_cast<const __m128i*>(w + b * 32);
      block_step<T>(_mm256_cvtepi8_epi16(_mm_loadu_si128(wb)), _mm256_cvtepi8_epi16(_mm_loadu_si128(wb + 1)), one,
                    x, b, acc0);
      block_step<T>(_mm256_cvtepi8_epi16(_mm_loadu_si128(wb + 2)), _mm256_cvtepi8_epi16(_mm_loadu_si128(wb + 3)), one,
                    x, b + 1, acc1);
    }
    if (b < NB) {
      const __m128i* wb = reinterpret_cast<const __m128i*>(w + b * 32);
      block_step<T>(_mm256_cvtepi8_epi16(_mm_loadu_si128(wb)), _mm256_cvtepi8_epi16(_mm_loadu_si128(wb + 1)), one,
                    x, b, acc0);
    }
    for (int t = 0; t < T; ++t) y[t * ldy + (n - n0)] = vhsum(vadd(acc0[t], acc1[t])) * s;
  }
}

// ---- int4 weights x int16 activations in nibble-pair order: (code - 8) widened to int16 ----
template <int T>
void gemv_int4_t(const Proj& p, int e, int n0, int n1, const Act* x, float* y, int ldy) {
  const int NB = p.k / kActBlock;
  const int shift = __builtin_ctz(unsigned(p.group / kActBlock));  // group = 32 << shift
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi16(8);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + e * p.w_estride + int64_t(n) * p.w_rstride;
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p.s + e * p.s_estride + int64_t(n) * p.s_rstride);
    V acc0[T], acc1[T];
    for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = vzero();
    auto step = [&](int b, V* acc) {
      __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      __m256i even = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(packed, mask)), eight);
      __m256i odd = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)), eight);
      block_step<T>(even, odd, bcast_bf16(s + (b >> shift)), x, b, acc);
    };
    int b = 0;
    for (; b + 2 <= NB; b += 2) {
      step(b, acc0);
      step(b + 1, acc1);
    }
    if (b < NB) step(b, acc0);
    for (int t = 0; t < T; ++t) y[t * ldy + (n - n0)] = vhsum(vadd(acc0[t], acc1[t]));
  }
}

#include "kernels_common.inc"

#define HETMOE_GEMV_DISPATCH(NAME)                                                               \
  void NAME(const Proj& p, int e, int n0, int n1, const Act* x, int T, float* y, int ldy) {      \
    switch (T) {                                                                                 \
      case 1: return NAME##_t<1>(p, e, n0, n1, x, y, ldy);                                      \
      case 2: return NAME##_t<2>(p, e, n0, n1, x, y, ldy);                                      \
      case 3: return NAME##_t<3>(p, e, n0, n1, x, y, ldy);                                      \
      default: return NAME##_t<4>(p, e, n0, n1, x, y, ldy);                                     \
    }                                                                                            \
  }
HETMOE_GEMV_DISPATCH(gemv_int8)
HETMOE_GEMV_DISPATCH(gemv_int4)

const KernelTable kTable = {
    "avx2",
    {gemv_bf16, gemv_int8, gemv_int4},
    {dequant_rows_bf16, dequant_rows_int8, dequant_rows_int4},
    gemm_panel,
    quantize_row,
    silu_mul,
    bf16_to_f32,
    fma_burn,
};

}  // namespace

const KernelTable* avx2_kernels() { return &kTable; }

}  // namespace hetmoe
