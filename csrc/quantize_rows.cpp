// The per-row weight quantizers: AVX2 + F16C, compiled with -ffp-contract=off (setup.py) so every
// float operation rounds where the Python codec's does. quantize_rows_avx512.cpp compiles this file
// again with HETMOE_QUANT_AVX512, where symmetric int4 takes two groups per 512-bit pass: the same
// operations lane for lane, so the bytes are the same. Each function is the row form of one codec
// in hetmoe/formats; the comments name it. Everything lives in an anonymous namespace and uses no
// std templates, so no inline function compiled with these flags can be shared with baseline code.
#include <immintrin.h>

#include <cstdint>

#include "quantize_rows.h"

namespace hetmoe {
namespace {

inline uint32_t bits_of(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  __builtin_memcpy(&x, &u, 4);
  return x;
}
inline bool finite(float x) { return (bits_of(x) & 0x7F800000u) != 0x7F800000u; }
inline float fmax_(float a, float b) { return a > b ? a : b; }
inline float fmin_(float a, float b) { return a < b ? a : b; }
inline float clamp_(float x, float lo, float hi) { return fmin_(fmax_(x, lo), hi); }  // torch.clamp(x, lo, hi)
inline float rne(float x) { return __builtin_nearbyintf(x); }  // torch.round: half to even
// x rounded to bf16 (ties to even) as fp32 bits, for finite x: torch's .to(torch.bfloat16)
inline uint32_t bf16_rounded_bits(float x) {
  const uint32_t u = bits_of(x);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}
inline float bf16_round(float x) { return float_of(bf16_rounded_bits(x)); }
inline uint16_t f16_bits(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
// A scale as the reader sees it (int_scales.round_to_stored), and its stored bits.
inline float stored_scale(float x, bool f16) { return f16 ? _cvtsh_ss(f16_bits(x)) : bf16_round(x); }
inline uint16_t stored_bits(float x, bool f16) { return f16 ? f16_bits(x) : uint16_t(bf16_rounded_bits(x) >> 16); }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline __m256 vabs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
inline __m256 vrne(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// max |x| over n values (n a multiple of 8); exact in any order.
inline float amax8(const float* x, int64_t n) {
  __m256 m = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) m = _mm256_max_ps(m, vabs(_mm256_loadu_ps(x + j)));
  return hmax(m);
}
inline float amax_any(const float* x, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  float m = n8 ? amax8(x, n8) : 0.0f;
  for (int64_t j = n8; j < n; ++j) m = fmax_(m, __builtin_fabsf(x[j]));
  return m;
}

// The squared error of a group (int_scales.squared_error): each difference squared in fp32 and
// summed in int_scales.lane_sum's order: lane l (of 8) adds elements 8j + l for j = 0, 1, ...;
// then (l, l + 4), then (l, l + 2), then the last two. Every step rounds as torch's elementwise
// ops do (nothing is fused: -ffp-contract=off, and no FMA intrinsic here).
struct LaneSum {
  __m256 acc;
  bool first = true;
  void add(__m256 d) {
    const __m256 sq = _mm256_mul_ps(d, d);
    acc = first ? sq : _mm256_add_ps(acc, sq);
    first = false;
  }
  float total() const {
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // (l, l + 4)
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                      // (l, l + 2)
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));                                   // the last two
  }
};

// Nibbles of 8 codes (floats holding 0..15), element 2i low and 2i + 1 high, into 4 bytes.
inline void pack8(__m256 codes, uint8_t* out) {
  alignas(32) int32_t c[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), _mm256_cvttps_epi32(codes));
  for (int i = 0; i < 4; ++i) out[i] = uint8_t(c[2 * i] | (c[2 * i + 1] << 4));
}

// Nibbles of 32 codes (floats holding 0..15) into 16 bytes, byte i = c[2i] | c[2i + 1] << 4: the
// pairs summed as c[2i] + 16 c[2i + 1] (exact small integers) by horizontal adds, narrowed to bytes
// and put back in order (the adds and packs work within 128-bit halves).
inline void pack32(const __m256* c, uint8_t* out) {
  const __m256 m = _mm256_setr_ps(1, 16, 1, 16, 1, 16, 1, 16);
  const __m256 h01 = _mm256_hadd_ps(_mm256_mul_ps(c[0], m), _mm256_mul_ps(c[1], m));  // B0 B1 B4 B5 | B2 B3 B6 B7
  const __m256 h23 = _mm256_hadd_ps(_mm256_mul_ps(c[2], m), _mm256_mul_ps(c[3], m));  // B8 B9 B12 B13 | ...
  const __m256i w = _mm256_packs_epi32(_mm256_cvttps_epi32(h01), _mm256_cvttps_epi32(h23));
  const __m256i b = _mm256_packus_epi16(w, w);  // low 8 bytes of each half: B0 B1 B4 B5 B8 B9 B12 B13 | B2 B3 ...
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi16(lo, hi));
}

// NaN/Inf among k values: the exponent all ones, counted 8 at a time.
int count_nonfinite(const float* dst, int64_t k) {
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  int bad = 0;
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256i e = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dst + i)), exponent);
    bad += __builtin_popcount(unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(e, exponent)))));
  }
  for (; i < k; ++i) bad += !finite(dst[i]);
  return bad;
}

int load_row(const void* src, int dtype, int64_t k, float* dst) {
  int64_t j = 0;
  if (dtype == 1) {  // bf16: the high half of an fp32
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (; j + 8 <= k; j += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j)));
      _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; j < k; ++j) dst[j] = float_of(uint32_t(s[j]) << 16);
  } else if (dtype == 2) {  // fp16: exact in fp32
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (; j + 8 <= k; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j))));
    for (; j < k; ++j) dst[j] = _cvtsh_ss(s[j]);
  } else {
    __builtin_memcpy(dst, src, size_t(k) * 4);
  }
  return count_nonfinite(dst, k);
}

// e4m3fn codes to fp32, exactly: the 7 magnitude bits shifted into an fp32's exponent and mantissa
// fields (bias 127 instead of 7) and multiplied by 2^120, which also makes the subnormal codes
// (exponent 0: m * 2^-9) exact, then the sign; 0x7F / 0xFF are NaN (e4m3fn has no infinities).
inline __m256 e4m3_to_f32(const uint8_t* codes) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
  const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
  return _mm256_blendv_ps(_mm256_or_ps(v, sign), _mm256_set1_ps(__builtin_nanf("")), nan);
}

int load_row_fp8(const uint8_t* codes, const float* scales, int64_t block_cols, int64_t k, float* dst) {
  int64_t j = 0;
  if (block_cols % 8 == 0) {  // eight values share a scale
    for (; j + 8 <= k; j += 8)
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(e4m3_to_f32(codes + j), _mm256_set1_ps(scales[j / block_cols])));
  }
  for (; j < k; ++j) {
    uint8_t eight[8] = {codes[j]};
    float one[8];
    _mm256_storeu_ps(one, e4m3_to_f32(eight));
    dst[j] = one[0] * scales[j / block_cols];
  }
  return count_nonfinite(dst, k);
}

// ---- int4, int4-asym (formats/int_scales.py symmetric_int4, asymmetric_int4) ----

constexpr float kSym4Divisors[8] = {7.0f, 7.25f, 7.5f, 7.75f, 8.0f, 8.25f, 8.5f, 9.0f};

// The 8 candidates' scales as stored, one per lane: stored(amax / d) for the divisors above.
inline __m256 sym4_scales(float amax, bool f16) {
  const __m256 raw = _mm256_div_ps(_mm256_set1_ps(amax), _mm256_loadu_ps(kSym4Divisors));
  if (f16) return _mm256_cvtph_ps(_mm256_cvtps_ph(raw, _MM_FROUND_TO_NEAREST_INT));
  const __m256i u = _mm256_castps_si256(raw);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
}

#ifdef HETMOE_QUANT_AVX512
// Two groups at once: group a's 8 candidates in lanes 0-7, group b's in lanes 8-15, each lane the
// operations sym4_scales / sym4_errors do for it.
inline __m512 halves(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
inline __m512 sym4_scales2(float amax_a, float amax_b, bool f16) {
  const __m256 d = _mm256_loadu_ps(kSym4Divisors);
  const __m512 raw = _mm512_div_ps(halves(_mm256_set1_ps(amax_a), _mm256_set1_ps(amax_b)), halves(d, d));
  if (f16) return _mm512_cvtph_ps(_mm512_cvtps_ph(raw, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m512i u = _mm512_castps_si512(raw);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline __m512 sym4_errors2(const float* a, const float* b, int64_t g, __m512 s, __m512 safe) {
  const __m512 lo = _mm512_set1_ps(-8.0f), hi = _mm512_set1_ps(7.0f);
  __m512 acc[8];
  for (int64_t j0 = 0; j0 < g; j0 += 8) {
    for (int l = 0; l < 8; ++l) {
      const __m512 v = halves(_mm256_broadcast_ss(a + j0 + l), _mm256_broadcast_ss(b + j0 + l));
      const __m512 q = _mm512_min_ps(
          _mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v, safe), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo),
          hi);
      const __m512 d = _mm512_sub_ps(v, _mm512_mul_ps(q, s));
      const __m512 sq = _mm512_mul_ps(d, d);
      acc[l] = j0 == 0 ? sq : _mm512_add_ps(acc[l], sq);
    }
  }
  const __m512 b0 = _mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6]));
  const __m512 b1 = _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7]));
  return _mm512_add_ps(b0, b1);
}
#endif

// All 8 candidates' squared errors of a group at once, candidate c in lane c: each element is
// broadcast and quantized against the 8 scales. The sum per candidate keeps LaneSum's order (the
// partial sums acc[l] hold elements 8j + l), so lane c equals what the scalar definition gives.
inline __m256 sym4_errors(const float* x, int64_t g, __m256 s, __m256 safe) {
  const __m256 lo = _mm256_set1_ps(-8.0f), hi = _mm256_set1_ps(7.0f);
  __m256 acc[8];
  for (int64_t j0 = 0; j0 < g; j0 += 8) {
    for (int l = 0; l < 8; ++l) {
      const __m256 v = _mm256_broadcast_ss(x + j0 + l);
      const __m256 q = _mm256_min_ps(_mm256_max_ps(vrne(_mm256_div_ps(v, safe)), lo), hi);
      const __m256 d = _mm256_sub_ps(v, _mm256_mul_ps(q, s));
      const __m256 sq = _mm256_mul_ps(d, d);
      acc[l] = j0 == 0 ? sq : _mm256_add_ps(acc[l], sq);
    }
  }
  const __m256 b0 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
  const __m256 b1 = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
  return _mm256_add_ps(b0, b1);
}

// The codes code(x[j..j+8)) of a group, packed two a byte: 32 at a time, the rest 8 at a time.
template <class Code>
inline void write_codes(const float* x, int64_t g, uint8_t* out, Code code) {
  int64_t j = 0;
  for (; j + 32 <= g; j += 32) {
    const __m256 c[4] = {code(_mm256_loadu_ps(x + j)), code(_mm256_loadu_ps(x + j + 8)),
                         code(_mm256_loadu_ps(x + j + 16)), code(_mm256_loadu_ps(x + j + 24))};
    pack32(c, out + j / 2);
  }
  for (; j < g; j += 8) pack8(code(_mm256_loadu_ps(x + j)), out + j / 2);
}

// The first of 8 candidates with the least error, as a running `err < best` keeps it.
inline int least_error(const float* err) {
  int c = 0;
  for (int i = 1; i < 8; ++i) c = err[i] < err[c] ? i : c;
  return c;
}

void int4_row(const float* w, int64_t k, int group, bool asym, int min_zero, bool f16, uint8_t* codes,
              uint16_t* scales, uint8_t* zeros) {
  float pending_b = -1.0f;  // (AVX-512) the next group's chosen scale, found with this one's; scales are >= 0
  (void)pending_b;
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    const float* x = w + g0;
    uint8_t* out = codes + g0 / 2;
    if (!asym) {
      // the scale among amax / d for the divisors above (each rounded to bf16) with the least error
      float best;
#ifdef HETMOE_QUANT_AVX512
      if (pending_b >= 0) {  // this group's scale came with the previous one's
        best = pending_b, pending_b = -1.0f;
      } else if (g0 + group < k) {
        const __m512 s = sym4_scales2(amax8(x, group), amax8(x + group, group), f16);
        const __m512 safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                 _mm512_set1_ps(1.0f), s);
        alignas(64) float err[16], scale[16];
        _mm512_store_ps(err, sym4_errors2(x, x + group, group, s, safe));
        _mm512_store_ps(scale, s);
        best = scale[least_error(err)], pending_b = scale[8 + least_error(err + 8)];
      } else
#endif
      {
        const __m256 s = sym4_scales(amax8(x, group), f16);
        const __m256 safe =
            _mm256_blendv_ps(_mm256_set1_ps(1.0f), s, _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ));
        alignas(32) float err[8], scale[8];
        _mm256_store_ps(err, sym4_errors(x, group, s, safe));
        _mm256_store_ps(scale, s);
        best = scale[least_error(err)];
      }
      const __m256 vsafe = _mm256_set1_ps(best > 0 ? best : 1.0f);
      write_codes(x, group, out, [&](__m256 v) {
        const __m256 q = _mm256_min_ps(_mm256_max_ps(vrne(_mm256_div_ps(v, vsafe)), _mm256_set1_ps(-8.0f)),
                                       _mm256_set1_ps(7.0f));
        return _mm256_add_ps(q, _mm256_set1_ps(8.0f));
      });
      scales[gi] = stored_bits(best, f16);
    } else {
      // the grid over min(min, 0)..max(max, 0): w = (q - z) * s
      __m256 mn = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
      for (int64_t j = 0; j < group; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        mn = _mm256_min_ps(mn, v), mx = _mm256_max_ps(mx, v);
      }
      const float lo = -hmax(_mm256_sub_ps(_mm256_setzero_ps(), mn)), hi = hmax(mx);  // lo <= 0 <= hi
      const float s = stored_scale((hi - lo) / 15.0f, f16);
      const float safe = s > 0 ? s : 1.0f;
      const float z = clamp_(rne(-lo / safe), float(min_zero), 15.0f);
      const __m256 vsafe = _mm256_set1_ps(safe), vz = _mm256_set1_ps(z);
      write_codes(x, group, out, [&](__m256 v) {
        const __m256 q = _mm256_add_ps(vrne(_mm256_div_ps(v, vsafe)), vz);
        return _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
      });
      scales[gi] = stored_bits(s, f16);
      zeros[gi] = uint8_t(z);
    }
  }
}

// ---- int8 (int_scales.symmetric_int8_rows), fp8-channel (formats/fp8_channel.py) ----

void int8_row(const float* w, int64_t k, int8_t* codes, float* scale) {
  const float s = amax_any(w, k) / 127.0f;
  const float safe = s > 0 ? s : 1.0f;
  for (int64_t j = 0; j < k; ++j) codes[j] = int8_t(clamp_(rne(w[j] / safe), -127.0f, 127.0f));
  *scale = s;
}

// fp32 -> float8_e4m3fn, round to nearest even, for |x| <= 448 (torch's .to(torch.float8_e4m3fn)).
inline uint8_t e4m3(float x) {
  const uint32_t u = bits_of(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const float a = __builtin_fabsf(x);
  if (a < 0.015625f) return uint8_t(sign | uint8_t(rne(a * 512.0f)));  // subnormals: steps of 2^-9 (8 = 2^-6)
  const uint32_t m = u & 0x7FFFFFFFu;
  const uint32_t r = (m + 0x7FFFFu + ((m >> 20) & 1u)) >> 20;  // exponent and 3 mantissa bits, rounded
  return uint8_t(sign | uint8_t(r - (120u << 3)));              // rebias 127 -> 7
}

void fp8_channel_row(const float* w, int64_t k, uint8_t* codes, float* scale) {
  const float amax = amax_any(w, k);
  const float s = amax > 0 ? amax / 448.0f : 1.0f;
  for (int64_t j = 0; j < k; ++j) codes[j] = e4m3(clamp_(w[j] / s, -448.0f, 448.0f));
  *scale = s;
}

// ---- mxfp4 (formats/mxfp4.py) ----

constexpr float kE2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr float kE2M1Mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

// 2^e for e in [-127, 127], exact (2^-127 is subnormal)
inline float pow2(int e) { return e >= -126 ? float_of(uint32_t(e + 127) << 23) : float_of(0x00400000u); }
// ceil(log2(x)) for finite x > 0, exact: x = f * 2^e with f in [0.5, 1)
inline int ceil_log2(float x) {
  int e;
  const float f = __builtin_frexpf(x, &e);
  return f == 0.5f ? e - 1 : e;
}

// The nearest E2M1 code of v (halfway: the smaller magnitude), sign in bit 3.
inline int e2m1_code(float v) {
  const float a = fmin_(__builtin_fabsf(v), 6.0f);
  int mag = 0;
  for (int i = 0; i < 7; ++i) mag += kE2M1Mid[i] < a;
  return mag + (v < 0 ? 8 : 0);
}

void mxfp4_row(const float* w, int64_t k, uint8_t* blocks, uint8_t* scales) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const float* x = w + 32 * b;
    const float amax = amax8(x, 32);
    int e_hi = ceil_log2(amax > 0 ? amax / 6.0f : 1.0f);
    e_hi = e_hi < -127 ? -127 : (e_hi > 127 ? 127 : e_hi);
    const int cand[2] = {e_hi, e_hi - 1 < -127 ? -127 : e_hi - 1};
    int best_e = cand[0];
    int best_codes[32];
    float best_err = 0.0f;
    for (int c = 0; c < 2; ++c) {
      const float scale = pow2(cand[c]);
      int codes[32];
      alignas(32) float diff[32];
      for (int j = 0; j < 32; ++j) {
        codes[j] = e2m1_code(x[j] / scale);
        const float value = (codes[j] & 8) ? -kE2M1[codes[j] & 7] : kE2M1[codes[j] & 7];
        diff[j] = x[j] - value * scale;
      }
      LaneSum acc;
      for (int j = 0; j < 32; j += 8) acc.add(_mm256_load_ps(diff + j));
      const float err = acc.total();
      if (c == 0 || err < best_err) {
        best_err = err, best_e = cand[c];
        for (int j = 0; j < 32; ++j) best_codes[j] = codes[j];
      }
    }
    for (int j = 0; j < 16; ++j) blocks[16 * b + j] = uint8_t(best_codes[2 * j] | (best_codes[2 * j + 1] << 4));
    scales[b] = uint8_t(best_e + 127);
  }
}

// ---- GGUF Q4_0, Q8_0 (formats/gguf/legacy.py encode_q4_0, encode_q8_0: ggml's reference quantizers) ----

inline float safe_inverse(float d) { return d == 0 ? 0.0f : 1.0f / d; }

void q4_0_row(const float* w, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 32; ++b, out += 18) {
    const float* x = w + 32 * b;
    float amax = __builtin_fabsf(x[0]), extreme = x[0];  // the first value of largest magnitude, sign kept
    for (int j = 1; j < 32; ++j)
      if (__builtin_fabsf(x[j]) > amax) amax = __builtin_fabsf(x[j]), extreme = x[j];
    const float d = extreme / -8.0f;
    const float id = safe_inverse(d);
    int q[32];
    for (int j = 0; j < 32; ++j) {
      const float t = x[j] * id;
      q[j] = int(clamp_(__builtin_truncf(t + 8.5f), 0.0f, 15.0f));
    }
    const uint16_t h = f16_bits(d);
    out[0] = uint8_t(h), out[1] = uint8_t(h >> 8);
    for (int j = 0; j < 16; ++j) out[2 + j] = uint8_t(q[j] | (q[j + 16] << 4));
  }
}

void q8_0_row(const float* w, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 32; ++b, out += 34) {
    const float* x = w + 32 * b;
    const float d = amax8(x, 32) / 127.0f;
    const float id = safe_inverse(d);
    const uint16_t h = f16_bits(d);
    out[0] = uint8_t(h), out[1] = uint8_t(h >> 8);
    for (int j = 0; j < 32; ++j) out[2 + j] = uint8_t(int8_t(__builtin_roundf(x[j] * id)));  // C roundf
  }
}

// ---- GGUF K-quants (formats/gguf/kquantize.py) and IQ4 (formats/gguf/nonlinear.py): hetmoe's own
// round-to-nearest encoders, scalar, each operation where the torch code has it ----

// int_scales.lane_sum of 32 values: lane l adds elements l, l + 8, l + 16, l + 24 in that order,
// then lanes (l, l + 4), then (l, l + 2), then the last two.
inline float lane_sum32(const float* v) {
  float acc[8];
  for (int l = 0; l < 8; ++l) acc[l] = ((v[l] + v[8 + l]) + v[16 + l]) + v[24 + l];
  for (int l = 0; l < 4; ++l) acc[l] = acc[l] + acc[l + 4];
  for (int l = 0; l < 2; ++l) acc[l] = acc[l] + acc[l + 2];
  return acc[0] + acc[1];
}
inline float f16_round(float x) { return _cvtsh_ss(f16_bits(x)); }  // .to(float16).to(float32)
inline void put_f16(float x, uint8_t* out) {
  const uint16_t h = f16_bits(x);
  out[0] = uint8_t(h), out[1] = uint8_t(h >> 8);
}
// The index of the first value of largest magnitude (torch's argmax of abs: the first maximum).
inline int argmax_abs(const float* x, int n) {
  int best = 0;
  for (int j = 1; j < n; ++j)
    if (__builtin_fabsf(x[j]) > __builtin_fabsf(x[best])) best = j;
  return best;
}

// kquantize._affine_fit of one 32-weight sub-block: (scale, min) with x ~ scale * q - min.
inline void affine_fit(const float* x, float nmax, float* out_scale, float* out_min) {
  float lo = x[0], hi = x[0];
  for (int j = 1; j < 32; ++j) lo = fmin_(lo, x[j]), hi = fmax_(hi, x[j]);
  lo = fmin_(lo, 0.0f);
  const float scale = (hi - lo) / nmax, mn = -lo;
  const float inv = safe_inverse(scale);
  float q[32], qx[32], e[32];
  float sq = 0, sqq = 0;  // sums of small integers: exact in any order
  for (int j = 0; j < 32; ++j) {
    q[j] = clamp_(rne((x[j] + mn) * inv), 0.0f, nmax);
    sq += q[j], sqq += q[j] * q[j], qx[j] = q[j] * x[j];
  }
  const float sx = lane_sum32(x), sqx = lane_sum32(qx);
  const float det = 32.0f * sqq - sq * sq;
  const bool ok = det > 0;
  float a = ok ? (32.0f * sqx - sq * sx) / det : scale;
  float c = ok ? (sx - a * sq) / 32.0f : -mn;
  if (!(ok && c <= 0 && a >= 0)) a = scale, c = -mn;  // min >= 0 and scale >= 0, or the range fit
  for (int j = 0; j < 32; ++j) {
    const float d = scale * q[j] - mn - x[j];
    e[j] = d * d;
  }
  const float err_old = lane_sum32(e);
  const float inv_a = safe_inverse(a);
  for (int j = 0; j < 32; ++j) {
    const float q2 = clamp_(rne((x[j] - c) * inv_a), 0.0f, nmax);
    const float d = a * q2 + c - x[j];
    e[j] = d * d;
  }
  const bool better = lane_sum32(e) < err_old;
  *out_scale = better ? a : scale, *out_min = better ? -c : mn;
}

// kquantize._six_bit: eight non-negative values -> an fp16 super-scale (as read back) and 6-bit ints.
inline float six_bit(const float* v, int* q) {
  float m = v[0];
  for (int j = 1; j < 8; ++j) m = fmax_(m, v[j]);
  const float d = f16_round(m / 63.0f), inv = safe_inverse(d);
  for (int j = 0; j < 8; ++j) q[j] = int(clamp_(rne(v[j] * inv), 0.0f, 63.0f));
  return d;
}

// kquantize._encode_affine_k of one 256-weight super-block: the 16 header bytes and the codes.
inline void affine_k_block(const float* x, float nmax, uint8_t* header, uint8_t* q) {
  float scale[8], mn[8];
  for (int s = 0; s < 8; ++s) affine_fit(x + 32 * s, nmax, scale + s, mn + s);
  int sc[8], mc[8];
  const float d = six_bit(scale, sc), dmin = six_bit(mn, mc);
  for (int s = 0; s < 8; ++s) {
    const float eff_s = d * float(sc[s]), eff_m = dmin * float(mc[s]), inv = safe_inverse(eff_s);
    for (int j = 0; j < 32; ++j) q[32 * s + j] = uint8_t(clamp_(rne((x[32 * s + j] + eff_m) * inv), 0.0f, nmax));
  }
  put_f16(d, header), put_f16(dmin, header + 2);
  for (int i = 0; i < 4; ++i) {  // kquantize._pack_scale_min_k4
    header[4 + i] = uint8_t((sc[i] & 0x3F) | ((sc[i + 4] >> 4) << 6));
    header[8 + i] = uint8_t((mc[i] & 0x3F) | ((mc[i + 4] >> 4) << 6));
    header[12 + i] = uint8_t((sc[i + 4] & 0x0F) | ((mc[i + 4] & 0x0F) << 4));
  }
}

// Sub-blocks 2c and 2c + 1 share bytes 32c..32c + 31 (low nibble, high nibble).
inline void pack_k_nibbles(const uint8_t* q, uint8_t* qs) {
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 32; ++j) qs[32 * c + j] = uint8_t((q[64 * c + j] & 0x0F) | ((q[64 * c + 32 + j] & 0x0F) << 4));
}

void q4_k_row(const float* w, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 256; ++b, out += 144) {
    uint8_t q[256];
    affine_k_block(w + 256 * b, 15.0f, out, q);
    pack_k_nibbles(q, out + 16);
  }
}

void q5_k_row(const float* w, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 256; ++b, out += 176) {
    uint8_t q[256];
    affine_k_block(w + 256 * b, 31.0f, out, q);
    for (int j = 0; j < 32; ++j) {  // qh[j]: bit s = the fifth bit of sub-block s's weight j
      int h = 0;
      for (int s = 0; s < 8; ++s) h |= (q[32 * s + j] >> 4) << s;
      out[16 + j] = uint8_t(h);
    }
    pack_k_nibbles(q, out + 48);
  }
}

void q6_k_row(const float* w, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 256; ++b, out += 210) {
    const float* x = w + 256 * b;
    float s[16];
    for (int i = 0; i < 16; ++i) s[i] = x[16 * i + argmax_abs(x + 16 * i, 16)] / -32.0f;
    float m = __builtin_fabsf(s[0]);
    for (int i = 1; i < 16; ++i) m = fmax_(m, __builtin_fabsf(s[i]));
    const float d = f16_round(m / 127.0f), inv = safe_inverse(d);
    uint8_t q[256];
    for (int i = 0; i < 16; ++i) {
      const float sc = clamp_(rne(s[i] * inv), -128.0f, 127.0f), inv_eff = safe_inverse(d * sc);
      out[192 + i] = uint8_t(int8_t(sc));
      for (int j = 0; j < 16; ++j) q[16 * i + j] = uint8_t(int(clamp_(rne(x[16 * i + j] * inv_eff), -32.0f, 31.0f)) + 32);
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* qh = q + 128 * h;
      for (int j = 0; j < 64; ++j) out[64 * h + j] = uint8_t((qh[j] & 0x0F) | ((qh[64 + j] & 0x0F) << 4));
      for (int j = 0; j < 32; ++j) {
        int v = 0;
        for (int t = 0; t < 4; ++t) v += (qh[32 * t + j] >> 4) << (2 * t);
        out[128 + 32 * h + j] = uint8_t(v);
      }
    }
    put_f16(d, out + 208);
  }
}

// IQ4's grid (nonlinear.KVALUES_IQ4NL) and its nearest-code rule: every decision boundary is a
// multiple of 0.5, so the code of v is the number of boundaries below ceil(2v) / 2 (ties go low),
// with 2v clamped to +-256 as nonlinear._half_step_index does.
constexpr float kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
struct IQ4CodeTable {
  uint8_t code[513];  // index ceil(2v) + 256
  constexpr IQ4CodeTable() : code() {
    for (int i = 0; i <= 512; ++i) {
      const float r = float(i - 256) / 2.0f;
      int c = 0;
      for (int m = 0; m < 15; ++m) c += (kIQ4Values[m] + kIQ4Values[m + 1]) / 2.0f < r;
      code[i] = uint8_t(c);
    }
  }
};
constexpr IQ4CodeTable kIQ4Codes;
inline int nearest_iq4(float v) {
  const float twice = v * 2.0f;  // NaN (a zero weight times an overflowed inverse scale): zero's code
  return kIQ4Codes.code[int(clamp_(__builtin_ceilf(twice == twice ? twice : 0.0f), -256.0f, 256.0f)) + 256];
}

// nonlinear._iq4_group_scales of one 32-weight group: 12 candidate scales, each refit by least
// squares on its nearest codes; the one of largest <x,k>^2 / <k,k> (the first on ties).
constexpr float kIQ4Stretch[6] = {0.8f, 0.85f, 0.9f, 0.95f, 1.0f, 1.05f};
inline float iq4_group_scale(const float* x) {
  const float xm = x[argmax_abs(x, 32)];
  const float bases[2] = {xm / -127.0f, xm / 113.0f};
  float best_score = 0, best_scale = 0;
  for (int c = 0; c < 12; ++c) {
    const float inv = safe_inverse(bases[c / 6] * kIQ4Stretch[c % 6]);
    float xk[32], skk = 0;  // skk: a sum of squared integers, exact in any order
    for (int j = 0; j < 32; ++j) {
      const float kv = kIQ4Values[nearest_iq4(x[j] * inv)];
      xk[j] = x[j] * kv, skk += kv * kv;
    }
    const float sxk = lane_sum32(xk), score = sxk * sxk / skk;
    if (c == 0 || score > best_score) best_score = score, best_scale = sxk / skk;
  }
  return best_scale;
}

// Codes of a group against its stored scale, packed as Q4_0's: byte j = code j | code j + 16 << 4.
inline void iq4_codes(const float* x, float d, uint8_t* qs) {
  const float inv = safe_inverse(d);
  int q[32];
  for (int j = 0; j < 32; ++j) q[j] = nearest_iq4(x[j] * inv);
  for (int j = 0; j < 16; ++j) qs[j] = uint8_t(q[j] | (q[j + 16] << 4));
}

void iq4_nl_row(const float* w, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 32; ++b, out += 18) {
    const float d = f16_round(iq4_group_scale(w + 32 * b));
    put_f16(d, out);
    iq4_codes(w + 32 * b, d, out + 2);
  }
}

void iq4_xs_row(const float* w, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 256; ++b, out += 136) {
    const float* x = w + 256 * b;
    float s[8];
    for (int i = 0; i < 8; ++i) s[i] = iq4_group_scale(x + 32 * i);
    const float d = f16_round(s[argmax_abs(s, 8)] / -32.0f), inv = safe_inverse(d);
    int u[8], sh = 0;
    for (int i = 0; i < 8; ++i) {
      const float ls = clamp_(rne(s[i] * inv), -32.0f, 31.0f);
      iq4_codes(x + 32 * i, d * ls, out + 8 + 16 * i);
      u[i] = int(ls) + 32, sh += (u[i] >> 4) << (2 * i);
    }
    put_f16(d, out);
    out[2] = uint8_t(sh & 0xFF), out[3] = uint8_t(sh >> 8);
    for (int i = 0; i < 4; ++i) out[4 + i] = uint8_t((u[2 * i] & 0x0F) | ((u[2 * i + 1] & 0x0F) << 4));
  }
}

constexpr QuantRowKernels kKernels = {load_row, load_row_fp8, int4_row, int8_row,  fp8_channel_row, mxfp4_row, q4_0_row,
                                      q8_0_row, q4_k_row,     q5_k_row, q6_k_row, iq4_nl_row,      iq4_xs_row};

}  // namespace

#ifdef HETMOE_QUANT_AVX512
const QuantRowKernels* quant_row_kernels_avx512() { return &kKernels; }
#else
const QuantRowKernels* quant_row_kernels() { return &kKernels; }
#endif

}  // namespace hetmoe
