// AVX-512 (F, BW, VL, VNNI) kernels: 16-lane fp32 and VPDPWSSD integer dot products.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -mf16c (setup.py); selected
// at run time only where CPUID reports all of them and the OS saves ZMM state.
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

namespace hetmoe {
namespace {

constexpr int LANES = 16;
using V = __m512;
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
inline float bf16_scalar(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline V vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline V vexp(V x) {
  x = _mm512_min_ps(_mm512_max_ps(x, vset1(-87.f)), vset1(88.f));
  V n = _mm512_roundscale_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return vmul(p, _mm512_castsi512_ps(e));
}

void widen_int8_row(const int8_t* w, int K, float s, float* dst) {
  const V sv = vset1(s);
  for (int k = 0; k < K; k += 16) {
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    vstore(dst + k, vmul(_mm512_cvtepi32_ps(v), sv));
  }
}

void widen_int4_row(const uint8_t* w, const uint16_t* s, int group, int K, float* dst) {
  const int shift = __builtin_ctz(unsigned(group / 32));
  const __m512i eight = _mm512_set1_epi32(8);
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int k = 0; k < K; k += 32) {
    const V sv = vset1(bf16_scalar(s[(k >> 5) >> shift]));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2));
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    __m512i c0 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), eight);
    __m512i c1 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), eight);
    vstore(dst + k, vmul(_mm512_cvtepi32_ps(c0), sv));
    vstore(dst + k + 16, vmul(_mm512_cvtepi32_ps(c1), sv));
  }
}

// Broadcast a bf16 scale to all lanes as fp32 (vpbroadcastw + shift: no scalar round trip).
inline V bcast_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi16(static_cast<short>(*p)), 16));
}

// The step of a weight row for one block of 32 and T tokens: integer dot products of the widened
// weights with each token's int16 block, scaled by (weight scale x activation block scale).
template <int T>
inline void block_step(__m512i wv, V sw, const Act* x, int b, V* acc) {
  for (int t = 0; t < T; ++t) {
    __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(x[t].q + b * 32));
    acc[t] = vfma(_mm512_cvtepi32_ps(dot), vmul(sw, vset1(x[t].d[b])), acc[t]);
  }
}

// ---- int8 weights x int16 activations: VPDPWSSD on weights widened to int16 ----
template <int T>
void gemv_int8_t(const Proj& p, int e, int n0, int n1, const Act* x, float* y, int ldy) {
  const int NB = p.k / kActBlock;
  const V one = vset1(1.f);
  for (int n = n0; n < n1; ++n) {
    const int8_t* w = reinterpret_cast<const int8_t*>(p.w + e * p.w_estride + int64_t(n) * p.w_rstride);
    const float s = *reinterpret_cast<const float*>(p.s + e * p.s_estride + int64_t(n) * p.s_rstride);
    // Two accumulator sets, even and odd blocks, so consecutive FMAs do not wait on each other.
    V acc0[T], acc1[T];
    for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = vzero();
    int b = 0;
    for (; b + 2 <= NB; b += 2) {
      block_step<T>(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32))), one, x,
                    b, acc0);
      block_step<T>(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32 + 32))),
                    one, x, b + 1, acc1);
    }
    if (b < NB)
      block_step<T>(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32))), one, x,
                    b, acc0);
    for (int t = 0; t < T; ++t) y[t * ldy + (n - n0)] = vhsum(vadd(acc0[t], acc1[t])) * s;
  }
}

// ---- int4 weights x int16 activations (nibble-pair order) ----
// 256-bit VNNI on purpose: 512-bit integer ops share fewer ports on current cores, and measured
// 256-bit VPDPWSSD streams these rows faster (docs/benchmarks.md).
using V8 = __m256;
template <int T>
inline void int4_block_step(__m256i even, __m256i odd, V8 sw, const Act* x, int b, V8* acc) {
  for (int t = 0; t < T; ++t) {
    const __m256i* xq = reinterpret_cast<const __m256i*>(x[t].q + b * 32);
    __m256i dot = _mm256_dpwssd_epi32(_mm256_setzero_si256(), even, _mm256_loadu_si256(xq));
    dot = _mm256_dpwssd_epi32(dot, odd, _mm256_loadu_si256(xq + 1));
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_set1_ps(x[t].d[b])), acc[t]);
  }
}

inline float hsum8(V8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int T>
void gemv_int4_t(const Proj& p, int e, int n0, int n1, const Act* x, float* y, int ldy) {
  const int NB = p.k / kActBlock;
  const int shift = __builtin_ctz(unsigned(p.group / kActBlock));  // group = 32 << shift
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi16(8);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + e * p.w_estride + int64_t(n) * p.w_rstride;
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p.s + e * p.s_estride + int64_t(n) * p.s_rstride);
    V8 acc0[T], acc1[T];
    for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
    auto step = [&](int b, V8* acc) {
      __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
      __m256i even = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(packed, mask)), eight);
      __m256i odd = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)), eight);
      V8 sw = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi16(static_cast<short>(s[b >> shift])), 16));
      int4_block_step<T>(even, odd, sw, x, b, acc);
    };
    int b = 0;
    for (; b + 2 <= NB; b += 2) {
      step(b, acc0);
      step(b + 1, acc1);
    }
    if (b < NB) step(b, acc0);
    for (int t = 0; t < T; ++t) y[t * ldy + (n - n0)] = hsum8(_mm256_add_ps(acc0[t], acc1[t]));
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
    "avx512",
    {gemv_bf16, gemv_int8, gemv_int4},
    {dequant_rows_bf16, dequant_rows_int8, dequant_rows_int4},
    gemm_panel,
    quantize_row,
    silu_mul,
    bf16_to_f32,
    fma_burn,
};

}  // namespace

const KernelTable* avx512_kernels() { return &kTable; }

}  // namespace hetmoe
