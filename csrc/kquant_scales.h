// The K-quants' (Q4_K, Q5_K) 6-bit sub-block scales and mins from a superblock's 12 packed bytes:
// ggml's get_scale_min_k4, for one sub-block (scalar: also in the baseline unit gguf_rows.cpp) and for
// all eight at once (AVX2: only in the ISA units); Q6_K's 6-bit codes (AVX2: the ISA units' GEMVs and
// dequantizers, and the AMX digit tiles).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace hetmoe {

// Sub-block j's scale and min.
inline void q4k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All 8 as fp32 lanes, on 32-bit words u0 u1 u2 in vector lanes (a scalar version read back as a
// vector stalls on store forwarding). The 16-byte load stays inside the superblock (the codes follow
// the scales). AVX2.
inline void k4_scales_mins(const uint8_t* s12, __m256* sc, __m256* mn) {
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s12));        // u0 u1 u2 -
  const __m128i u22 = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 2, 2, 2));                // u2 u2
  const __m128i m2 = _mm_set1_epi32(0x0f0f0f0f), m3 = _mm_set1_epi32(0x03030303);
  const __m128i lo = _mm_and_si128(u, _mm_set1_epi32(0x3f3f3f3f));                  // sc0-3 m0-3
  const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srlv_epi32(u22, _mm_setr_epi32(0, 4, 0, 0)), m2),
                                  _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(u, 6), m3), 4));  // sc4-7 m4-7
  const __m128i both = _mm_unpacklo_epi32(lo, hi);  // sc0-3 sc4-7 m0-3 m4-7
  *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
  *mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8)));
}

// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales (one per 16 weights), d (fp16).
// Each half of 128 weights: codes for [0,32), [32,64), [64,96), [96,128) come from the low/high
// nibbles of ql[0:32] / ql[32:64] and successive bit pairs of qh[0:32]; w = d * sc * (q - 32).
// A half's four vectors of 32 codes (0-63) in k order, from its ql (64 bytes) and qh (32). AVX2.
#if defined(__AVX2__)  // the baseline unit (gguf_rows.cpp) has no use for it, nor the AVX ABI
inline void q6k_codes(const uint8_t* ql, const uint8_t* qh, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  // bits shift, shift + 1 of every byte to bits 4, 5 (16-bit shifts; the mask keeps each byte's own)
  auto hi2 = [&](int shift) {
    const __m256i moved = shift <= 4 ? _mm256_slli_epi16(h, 4 - shift) : _mm256_srli_epi16(h, shift - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
  };
  q[0] = _mm256_or_si256(_mm256_and_si256(a, m4), hi2(0));
  q[1] = _mm256_or_si256(_mm256_and_si256(b, m4), hi2(2));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), hi2(4));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), hi2(6));
}
#endif

}  // namespace hetmoe
