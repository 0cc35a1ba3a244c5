// AMX variant: the AVX-512 kernels, with prefill GEMMs on AMX tiles (TDPBF16PS; TDPBSSD for int8).
// Compiled with -mamx-tile -mamx-bf16 plus the AVX-512 flags (setup.py); selected only where CPUID
// reports AMX and the kernel granted this process tile data (cpu_features.cpp). The same source,
// compiled with HETMOE_AMX_EMULATED (kernels_amx_emu.cpp), runs its tile operations through the
// scalar emulator in amx_tiles.h: the test-only variant "amx-emu".
//
// c[t][r] = dot(w[r], x[t]) with the weights as A tiles and the activations as B tiles:
// - A: 16 weight rows x 32 k in bf16, which is the row-major layout weights already have, so a bf16
//   weight's rows are tile rows as stored (tile loads with the row stride; nothing is repacked, at
//   load or per call) and a dequantized panel is a row-major bf16 buffer;
// - B: 32 k x 16 tokens in AMX's pair layout, B[kp][2n + i] = x[n][2kp + i], packed once per
//   expert's tokens (or per token chunk of a linear) by amx_pack and reused for all its rows.
// C is 16 rows x 16 tokens in fp32; four of them (32 rows x 32 tokens) live in tiles 0-3 across the
// whole K loop, A in tiles 4-5, B in tiles 6-7 (all eight, configured per call: configure_tiles).
//
// Accuracy: a value v is split as hi = bf16(v) and lo = bf16(v - hi), and the product is
// w_hi x_hi + w_hi x_lo + w_lo x_hi: each bf16 product is exact in fp32, and the dropped w_lo x_lo
// and the rounding of the two lo terms are each at most 2^-18 of the product (3 * 2^-18 ~ 1.1e-5 in
// all; accumulation in fp32), against bf16 operands' ~4e-3. Where a side is exactly bf16 (bf16
// weights; bf16 activations) its lo term is absent and the pass is skipped: bf16 x bf16 is one pass.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "kquant_scales.h"
#include "method_traits.h"

namespace hetmoe {
namespace {

#include "amx_tiles.h"

// code - 8, code - z[g], E2M1; GGUF Q4_0 blocks (fp16 d inside, code - 8, low nibbles k 0-15); GGUF Q4_K
// superblocks (w = d * sc * code - dmin * m per sub-block of 32), and Q5_K's (the same with 5-bit codes);
// GGUF Q8_0 blocks (fp16 d inside, 32 int8 codes in k order: bytes, not nibbles, on the same tiles); GGUF
// Q6_K superblocks (6-bit codes, on the digit tiles only)
enum NibbleKind {
  kNibbleEight = 0,
  kNibbleZeros = 1,
  kNibbleE2M1 = 2,
  kNibbleQ4_0 = 3,
  kNibbleQ4K = 4,
  kNibbleQ5K = 5,
  kByteQ8_0 = 6,
  kSixBitQ6K = 7,  // GGUF Q6_K superblocks (w = d * sc * (code - 32), a scale per 16): the digit tiles only
};
constexpr bool has_min(int decode) { return decode == kNibbleQ4K || decode == kNibbleQ5K; }

// 16 fp32 -> 16 bf16, round to nearest even (finite inputs).
inline __m256i to_bf16x16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
inline __m512 from_bf16x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// hi = bf16(v), lo = bf16(v - hi) for 32 values at `src`, stored as 32 bf16 each.
inline void split32(const float* src, uint16_t* hi, uint16_t* lo) {
  for (int h = 0; h < 32; h += 16) {
    const __m512 v = _mm512_loadu_ps(src + h);
    const __m256i vh = to_bf16x16(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + h), vh);
    if (lo) _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + h), to_bf16x16(_mm512_sub_ps(v, from_bf16x16(vh))));
  }
}

// In-register transpose of a 16 x 16 matrix of 32-bit values: r[i][l] becomes r[l][i]. Four rounds
// swap the off-diagonal blocks of 8, 4, 2 and 1 between rows i and i + b.
inline void transpose16(__m512i r[16]) {
  for (int b = 8; b >= 1; b /= 2) {
    alignas(64) int32_t lo_idx[16], hi_idx[16];
    for (int l = 0; l < 16; ++l) {
      lo_idx[l] = (l & b) ? 16 + l - b : l;
      hi_idx[l] = (l & b) ? 16 + l : l + b;
    }
    const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const __m512i a = r[i], c = r[i + b];
      r[i] = _mm512_permutex2var_epi32(a, il, c);
      r[i + b] = _mm512_permutex2var_epi32(a, ih, c);
    }
  }
}

// 16 rows of 64 bytes (r[n]: token n's 16 dwords) stored as the B tile's 16 rows of 16 tokens' dwords at dst.
inline void store_tile_transposed(__m512i r[16], void* dst) {
  transpose16(r);
  for (int k = 0; k < 16; ++k) _mm512_storeu_si512(static_cast<uint8_t*>(dst) + 64 * k, r[k]);
}
// The same from 16 rows of 64 bytes at src, 64-byte aligned.
inline void store_transposed(const void* src, void* dst) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_load_si512(static_cast<const uint8_t*>(src) + 64 * n);
  store_tile_transposed(r, dst);
}

// Activation rows as B tiles (layout above): hi[(j * K/32 + s) * 512 ...] is the tile of tokens
// [16j, 16j + 16) and k [32s, 32s + 32); tokens past T are zero. lo (optional) the same for the
// remainders.
void amx_pack(const float* const* a, int T, int K, uint16_t* hi, uint16_t* lo) {
  const int S = K / 32, J = (T + 15) / 16;
  alignas(64) uint16_t rows_hi[16][32], rows_lo[16][32];
  for (int j = 0; j < J; ++j)
    for (int s = 0; s < S; ++s) {
      for (int n = 0; n < 16; ++n) {
        const int t = 16 * j + n;
        if (t < T) {
          split32(a[t] + 32 * s, rows_hi[n], lo ? rows_lo[n] : nullptr);
        } else {
          std::memset(rows_hi[n], 0, 64);
          std::memset(rows_lo[n], 0, 64);
        }
      }
      // Token n's 16 pairs are dwords 0-15 of its row; the tile wants pair kp's 16 tokens in a row.
      store_transposed(rows_hi[0], hi + (int64_t(j) * S + s) * 512);
      if (lo) store_transposed(rows_lo[0], lo + (int64_t(j) * S + s) * 512);
    }
}

// bf16 hi (and lo) rows of an fp32 panel: hi[r * K + k] = bf16(panel[r * K + k]), as split32.
void amx_split(const float* panel, int R, int K, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < int64_t(R) * K; i += 32) split32(panel + i, hi + i, lo ? lo + i : nullptr);
}

// All eight tiles 16 rows x 64 bytes. Loaded at each amx_gemm call and released at its end, never
// assumed kept: other code on the same thread (torch's oneDNN kernels, on the caller thread that
// helps the pool) configures and releases tiles too, and a tile instruction without a configuration
// faults. LDTILECFG costs ~0.1% of one call's tile work.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  tile_configure(cfg);
}

// C tiles (row group g, token tile b) to c[t * ldc + r], rows [r0, r0 + 16) clipped to R, tokens
// [t0, t0 + 16) clipped to T.
inline void store_c(const float (*tile)[16], int r0, int R, int t0, int T, float* c, int ldc) {
  __m512i r[16];
  for (int m = 0; m < 16; ++m) r[m] = _mm512_load_si512(tile[m]);
  transpose16(r);  // r[n] = token n's 16 rows
  const int rows = R - r0 < 16 ? R - r0 : 16;
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (int n = 0; n < 16 && t0 + n < T; ++n)
    _mm512_mask_storeu_ps(c + int64_t(t0 + n) * ldc + r0, mask, _mm512_castsi512_ps(r[n]));
}

// ---- The bf16 tile loop both bf16 GEMMs (amx_gemm, gemm_nibble_t) run ----
// C tile 2g + b: row group g (rows 16g..16g+15) x token tile b of a pair. A rows in tiles 4-5, B in 6-7.
inline void dp_block(bool two_rows, bool two_tok) {
  TILE_DPBF16PS(0, 4, 6);
  if (two_tok) TILE_DPBF16PS(1, 4, 7);
  if (two_rows) TILE_DPBF16PS(2, 5, 6);
  if (two_rows && two_tok) TILE_DPBF16PS(3, 5, 7);
}

inline void zero_c() {
  TILE_ZERO(0);
  TILE_ZERO(1);
  TILE_ZERO(2);
  TILE_ZERO(3);
}
// The four C tiles to and from memory as [4][16][16] floats.
inline void save_c(float* cc) {
  TILE_STORE(0, cc, 64);
  TILE_STORE(1, cc + 256, 64);
  TILE_STORE(2, cc + 512, 64);
  TILE_STORE(3, cc + 768, 64);
}
inline void load_c(const float* cc) {
  TILE_LOAD(0, cc, 64);
  TILE_LOAD(1, cc + 256, 64);
  TILE_LOAD(2, cc + 512, 64);
  TILE_LOAD(3, cc + 768, 64);
}

// Token pair j's C tiles, saved as [4][16][16], to c: rows clipped to R, tokens to T.
inline void write_c(const float (*out)[16][16], int j, int J, int R, int T, float* c, int ldc) {
  for (int g = 0; g < (R > 16 ? 2 : 1); ++g) {
    store_c(out[2 * g], 16 * g, R, 16 * j, T, c, ldc);
    if (j + 1 < J) store_c(out[2 * g + 1], 16 * g, R, 16 * j + 16, T, c, ldc);
  }
}

// The tile products of ns k-steps into the C tiles: w_hi x_hi, then w_hi x_lo and w_lo x_hi where
// the lo parts exist. Step s's A rows start at a_hi + 32 s (rows 16-31 a_row16 elements further),
// a_stride bytes apart; its B tiles are x + b0 + (b_step0 + s) * 512 (and + b1 for the second token tile).
inline void tile_ksteps(const uint16_t* a_hi, const uint16_t* a_lo, int64_t a_stride, int64_t a_row16,
                        const uint16_t* x_hi, const uint16_t* x_lo, int64_t b0, int64_t b1, int b_step0, int ns,
                        bool two_rows, bool two_tok) {
  for (int s = 0; s < ns; ++s) {
    const int64_t k0 = 32 * s, bs = int64_t(b_step0 + s) * 512;
    // B tiles come from L2 (a token tile's K of activations is 64 KiB at K 2048) and tile registers
    // are not renamed: the next step's loads wait for this step's products, so fetch them into L1 now
    for (int l = 0; l < 512; l += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(x_hi + b0 + bs + 512 + l), _MM_HINT_T0);
      if (two_tok) _mm_prefetch(reinterpret_cast<const char*>(x_hi + b1 + bs + 512 + l), _MM_HINT_T0);
    }
    TILE_LOAD(4, a_hi + k0, a_stride);
    if (two_rows) TILE_LOAD(5, a_hi + a_row16 + k0, a_stride);
    TILE_LOAD(6, x_hi + b0 + bs, 64);
    if (two_tok) TILE_LOAD(7, x_hi + b1 + bs, 64);
    dp_block(two_rows, two_tok);
    if (x_lo) {  // w_hi x_lo
      TILE_LOAD(6, x_lo + b0 + bs, 64);
      if (two_tok) TILE_LOAD(7, x_lo + b1 + bs, 64);
      dp_block(two_rows, two_tok);
    }
    if (a_lo) {  // w_lo x_hi
      TILE_LOAD(4, a_lo + k0, a_stride);
      if (two_rows) TILE_LOAD(5, a_lo + a_row16 + k0, a_stride);
      if (x_lo) {
        TILE_LOAD(6, x_hi + b0 + bs, 64);
        if (two_tok) TILE_LOAD(7, x_hi + b1 + bs, 64);
      }
      dp_block(two_rows, two_tok);
    }
  }
}

// c[t * ldc + r] = dot(w[r], x[t]) for r < R (<= 32), t < T, K a multiple of 32; the passes the
// header describes. w_hi (and w_lo) rows are w_stride elements apart and 16 * ceil(R / 16) of them
// must be readable (rows past R are computed and dropped). x_hi / x_lo: amx_pack's tiles.
void amx_gemm(const uint16_t* w_hi, const uint16_t* w_lo, int64_t w_stride, int R, int K, const uint16_t* x_hi,
              const uint16_t* x_lo, int T, float* c, int ldc) {
  configure_tiles();
  const int S = K / 32, J = (T + 15) / 16;
  alignas(64) float out[4][16][16];
  for (int j = 0; j < J; j += 2) {
    const int64_t b0 = int64_t(j) * S * 512, b1 = b0 + int64_t(S) * 512;
    zero_c();
    tile_ksteps(w_hi, w_lo, w_stride * 2, 16 * w_stride, x_hi, x_lo, b0, b1, 0, S, R > 16, j + 1 < J);
    save_c(out[0][0]);
    write_c(out, j, J, R, T, c, ldc);
  }
  tile_release();
}

// ---- 4- and 5-bit rows (int4 sym/asym, gptq repacked, GGUF Q4_0, Q4_K and Q5_K, mxfp4): codes into tiles ----
// A 4-bit weight is w = scale_g * v with v an integer code value: code - zero (int4, Q4_0), twice an
// E2M1 value (mxfp4, its scale halved), or the code itself (Q4_K, Q5_K: w = scale_g * code - min_g
// has a min term, min_g times the activations' sum over the sub-block, tile_path.h's TileActs::sums,
// subtracted where the scale is applied). |v| <= 31, so v is exact in bf16 and the weights enter the
// tiles with no lo part: one pass against bf16 activations, two against fp32 ones (v x_hi + v x_lo).
// Each 32-row block is decoded kNibbleChunk columns at a time into bf16 A rows that stay in L1, and
// for each span of k sharing a scale (a group, at most the chunk) the tiles compute the span's dot
// products from zero, which are stored and added to fp32 accumulators times each row's scale. The
// products v * x_hi are exact in fp32; the sums round in fp32, then once more for the scale.
// Cost: per span a tile store and a multiply-add per C row (on this path's profile that is as long
// as the span's tile products at groups of 32), against converting every weight to fp32, splitting it
// into hi/lo bf16 and a second tile pass (the kernel before: 1.1-1.3x the time at 512 tokens).
constexpr int kNibbleChunk = 256;

inline float bf16_value(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int Kind>
inline float nibble_scale(const uint8_t* s, int g) {
  if constexpr (Kind == kScaleBF16) return bf16_value(reinterpret_cast<const uint16_t*>(s)[g]);
  if constexpr (Kind == kScaleF16) return _cvtsh_ss(reinterpret_cast<const uint16_t*>(s)[g]);
  // e8m0, and E2M1 codes are looked up doubled (below): 2^(e - 128)
  uint32_t u = s[g] > 1 ? uint32_t(s[g] - 1) << 23 : (s[g] ? 1u << 22 : 1u << 21);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The bf16 words a 5-bit index looks up (vpermw): for E2M1, twice the value of code i (i < 16); for
// the K-quants' unsigned codes bf16(i); for the other integer codes bf16(i - 16), indexed by
// code + 16 - zero.
inline uint16_t bf16_of_small_int(int v) {
  const float f = float(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);  // exact: |v| < 256
}
inline int nibble_value(int decode, int i) {
  static const int kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  return decode == kNibbleE2M1 ? (i < 16 ? kE2M1x2[i] : 0) : has_min(decode) ? i : i - 16;
}
template <int Decode>
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = bf16_of_small_int(nibble_value(Decode, i));
  return _mm512_load_si512(t);
}

// 32 codes (16 bytes) as the tile row's 32 bf16 values in k order. Interleaved (int4, mxfp4): byte i
// holds k 2i (low nibble) and 2i + 1 (high), so each byte becomes one dword of two word indices.
// Halves (Q4_0): low nibbles are k 0-15, high nibbles k 16-31.
template <bool Halves>
inline __m512i nibble_index(const uint8_t* codes) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  if constexpr (Halves) {
    const __m256i b = _mm256_cvtepu8_epi16(packed);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(0x0F))),
                              _mm256_srli_epi16(b, 4), 1);
  } else {  // (b | b << 12) & 0x000F000F: the low nibble in the low word, the high one in the high word
    const __m512i b = _mm512_cvtepu8_epi32(packed);
    return _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  }
}
template <bool Halves>
inline __m512i nibble_row(const uint8_t* codes, __m512i offset, __m512i table) {
  return _mm512_permutexvar_epi16(_mm512_add_epi16(nibble_index<Halves>(codes), offset), table);
}

// Every cache line of [at, at + bytes) into L1.
inline void prefetch_lines(const uint8_t* at, int64_t bytes) {
  for (uintptr_t l = reinterpret_cast<uintptr_t>(at) & ~uintptr_t(63); l < reinterpret_cast<uintptr_t>(at) + bytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(l), _MM_HINT_T0);
}

// Where the decode of a row's chunk reads next: the row's next chunk, or after its last chunk the
// first chunk of the row kAmxRows below (the next block tile_rows decodes). The 32 rows of a block are
// 32 strided streams, and before this only the first line of a row's next chunk was fetched (perf on
// the int4 layer at 512 tokens: a sixth of the kernel's samples on the load of the codes; in-process
// A/B on the AMX Xeon, 16 rounds: median 120 against 135 ms in one run, no difference beyond the noise
// in another). The chunk now decoded spans row[at, at + bytes).
inline void prefetch_next_chunk(const uint8_t* row, int64_t at, int64_t bytes, int64_t row_stride, bool last_chunk) {
  prefetch_lines(last_chunk ? row + 32 * row_stride : row + at + bytes, bytes);
}

// Rows [r0, r0 + rows) of expert e, columns [k0, k0 + kc), as bf16 code values into a[rows][kNibbleChunk]
// (zero rows past R), and each row's scale for each span of `span` k into scale[span index][row]
// (Q4_K: its min as well, into minv).
template <int Decode, int Kind>
void decode_nibble_chunk(const Proj& p, int e, int r0, int R, int rows, int k0, int kc, int span, uint16_t* a,
                         float (*scale)[32], float (*minv)[32]) {
  const __m512i table = nibble_table<Decode>();
  const int gshift = p.group > 0 ? __builtin_ctz(unsigned(p.group)) : 0;  // groups: powers of two (bindings.cpp)
  for (int r = 0; r < rows; ++r) {
    uint16_t* h = a + r * kNibbleChunk;
    if (r >= R) {
      std::memset(h, 0, kc * 2);
      for (int u = 0; u < kc / span; ++u) scale[u][r] = 0.f;
      if constexpr (has_min(Decode))
        for (int u = 0; u < kc / span; ++u) minv[u][r] = 0.f;
      continue;
    }
    const int n = r0 + r;
    if constexpr (has_min(Decode)) {  // one superblock a chunk of 256: d, dmin, 12 bytes of 6-bit scales
      // and mins, (Q5_K: 32 bytes whose bit b is sub-block b's fifth code bit,) then 128 bytes whose
      // 32-byte part j holds sub-block 2j in its low nibbles and 2j + 1 in its high ones, in k order
      constexpr int bytes = Decode == kNibbleQ4K ? 144 : 176, codes_at = Decode == kNibbleQ4K ? 16 : 48;
      const uint8_t* row = p.w + e * p.w_estride + int64_t(n) * p.w_rstride;
      const uint8_t* sb = row + int64_t(k0 / 256) * bytes;
      prefetch_next_chunk(row, sb - row, bytes, p.w_rstride, k0 + kc >= p.k);
      uint16_t d16, m16;
      std::memcpy(&d16, sb, 2);
      std::memcpy(&m16, sb + 2, 2);
      const float d = _cvtsh_ss(d16), dmin = _cvtsh_ss(m16);
      const uint8_t* q = sb + 4;  // scales and mins
      const __m256i qh = Decode == kNibbleQ5K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16))
                                              : _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i part = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + codes_at + 32 * j));
        const __m256i codes[2] = {_mm256_and_si256(part, _mm256_set1_epi8(0x0F)),
                                  _mm256_and_si256(_mm256_srli_epi16(part, 4), _mm256_set1_epi8(0x0F))};
        for (int half = 0; half < 2; ++half) {
          const int b = 2 * j + half;
          int sc, m;
          q4k_scale_min(q, b, &sc, &m);
          scale[b][r] = d * float(sc);
          minv[b][r] = dmin * float(m);  // exact: 11 significant bits times 6
          __m256i c = codes[half];
          if constexpr (Decode == kNibbleQ5K) {  // bit b of each qh byte -> 16 (cmpeq keeps it bytewise)
            const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << b));
            c = _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                    _mm256_set1_epi8(16)));
          }
          _mm512_storeu_si512(h + 32 * b, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(c), table));
        }
      }
      continue;
    }
    if constexpr (Decode == kByteQ8_0) {  // 34-byte blocks of 32: fp16 d, then 32 int8 codes; span 32
      constexpr int64_t bytes = sizeof(BlockQ8_0);
      const uint8_t* row = p.w + e * p.w_estride + int64_t(n) * p.w_rstride;
      prefetch_next_chunk(row, (k0 / 32) * bytes, (kc / 32) * bytes, p.w_rstride, k0 + kc >= p.k);
      for (int k = 0; k < kc; k += 32) {
        const uint8_t* block = row + (k0 + k) / 32 * bytes;
        uint16_t d16;
        std::memcpy(&d16, block, 2);
        scale[k / 32][r] = _cvtsh_ss(d16);
        // |code| <= 128 is exact in bf16 (8 significant bits), so the conversion rounds nothing
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
        _mm512_storeu_si512(h + k, _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16x16(f0)), to_bf16x16(f1), 1));
      }
      continue;
    }
    if constexpr (Decode == kNibbleQ4_0) {  // 18-byte blocks of 32: fp16 d, then the codes; span 32
      const uint8_t* row = p.w + e * p.w_estride + int64_t(n) * p.w_rstride;
      prefetch_next_chunk(row, int64_t(k0 / 32) * 18, int64_t(kc / 32) * 18, p.w_rstride, k0 + kc >= p.k);
      const __m512i eight = _mm512_set1_epi16(16 - 8);
      for (int k = 0; k < kc; k += 32) {
        const uint8_t* block = row + int64_t((k0 + k) / 32) * 18;
        uint16_t d16;
        std::memcpy(&d16, block, 2);
        scale[k / 32][r] = _cvtsh_ss(d16);
        _mm512_storeu_si512(h + k, nibble_row<true>(block + 2, eight, table));
      }
      continue;
    }
    const uint8_t* w_row = p.w + e * p.w_estride + int64_t(n) * p.w_rstride, *w = w_row + k0 / 2;
    const uint8_t* s = p.s + e * p.s_estride + int64_t(n / p.s_row_div) * p.s_rstride;
    const uint8_t* z = Decode == kNibbleZeros ? p.z + e * p.z_estride + int64_t(n) * p.z_rstride : nullptr;
    const int g0 = k0 / p.group, spans_per_group = span / p.group;  // 0 where a group covers the chunk
    const bool last_chunk = k0 + kc >= p.k;
    prefetch_next_chunk(w_row, k0 / 2, kc / 2, p.w_rstride, last_chunk);
    const int scale_bytes = scale_kind_bytes(Kind), groups = kc >= p.group ? kc / p.group : 1;
    if (p.s_row_div == 1) prefetch_next_chunk(s, g0 * scale_bytes, groups * scale_bytes, p.s_rstride, last_chunk);
    if (z) prefetch_next_chunk(z, g0, groups, p.z_rstride, last_chunk);
    for (int u = 0; u < kc / span; ++u) scale[u][r] = nibble_scale<Kind>(s, g0 + u * spans_per_group);
    for (int k = 0; k < kc; k += 32) {
      const int zero = Decode == kNibbleZeros ? z[g0 + (k >> gshift)] : Decode == kNibbleEight ? 8 : 16;
      _mm512_storeu_si512(h + k, nibble_row<false>(w + k / 2, _mm512_set1_epi16(int16_t(16 - zero)), table));
    }
  }
}

// acc[t] += scale[row of C tile t, m] * part[t] for the C tiles in use (tile 2g + b: row group g,
// token tile b); a row's scale is broadcast once for both token tiles. With a min term (minv not
// null), acc[t] -= minv[row] * the sums of token tile b (sum0, sum1: 16 tokens' sums over the span).
inline void add_scaled(float (*acc)[16][16], const float (*part)[16][16], const float* scale, const float* minv,
                       const float* sum0, const float* sum1, bool two_rows, bool two_tok) {
  const __m512 s0 = minv ? _mm512_loadu_ps(sum0) : _mm512_setzero_ps();
  const __m512 s1 = minv && two_tok ? _mm512_loadu_ps(sum1) : _mm512_setzero_ps();
  for (int g = 0; g < (two_rows ? 2 : 1); ++g)
    for (int m = 0; m < 16; ++m) {
      const __m512 sc = _mm512_set1_ps(scale[16 * g + m]);
      float* a0 = acc[2 * g][m];
      __m512 v0 = _mm512_fmadd_ps(sc, _mm512_load_ps(part[2 * g][m]), _mm512_load_ps(a0));
      if (minv) v0 = _mm512_fnmadd_ps(_mm512_set1_ps(minv[16 * g + m]), s0, v0);
      _mm512_store_ps(a0, v0);
      if (two_tok) {
        float* a1 = acc[2 * g + 1][m];
        __m512 v1 = _mm512_fmadd_ps(sc, _mm512_load_ps(part[2 * g + 1][m]), _mm512_load_ps(a1));
        if (minv) v1 = _mm512_fnmadd_ps(_mm512_set1_ps(minv[16 * g + m]), s1, v1);
        _mm512_store_ps(a1, v1);
      }
    }
}

// c[t * ldc + r] = dot(W_e[r0 + r], x_t) for r < R (<= 32), x packed by amx_pack; x_sum: TileActs::sums (tile_path.h)
// (read only for Q4_K).
template <int Decode, int Kind>
void gemm_nibble_t(const Proj& p, int e, int r0, int R, const uint16_t* x_hi, const uint16_t* x_lo, int T,
                   const float* x_sum, float* c, int ldc) {
  const int K = p.k, J = (T + 15) / 16, pairs = (J + 1) / 2, Tp = 16 * J;
  const int64_t S = K / 32;
  const bool two_rows = R > 16;
  const int rows = two_rows ? 32 : 16;
  // k sharing one scale within a chunk: the GGUF types' and mxfp4's blocks of 32, else the group (the
  // engine's groups are 32 times a power of two, so a chunk holds whole groups or lies inside one)
  constexpr bool blocks32 = Decode == kNibbleQ4_0 || Decode == kByteQ8_0 || Decode == kNibbleE2M1 || has_min(Decode);
  const int span = blocks32 ? 32 : std::min(p.group, kNibbleChunk);
  alignas(64) uint16_t a[32 * kNibbleChunk];
  alignas(64) float scale[kNibbleChunk / 32][32];
  alignas(64) float minv[kNibbleChunk / 32][32];
  alignas(64) float part[4][16][16];
  thread_local std::vector<float> acc_buf;  // every token pair's accumulators, 64-byte aligned below
  if (acc_buf.size() < size_t(pairs) * 1024 + 16) acc_buf.resize(size_t(pairs) * 1024 + 16);
  const uintptr_t base = reinterpret_cast<uintptr_t>(acc_buf.data());
  auto* acc = reinterpret_cast<float(*)[4][16][16]>((base + 63) & ~uintptr_t(63));
  std::memset(acc, 0, size_t(pairs) * 1024 * sizeof(float));
  configure_tiles();
  for (int k0 = 0; k0 < K; k0 += kNibbleChunk) {
    const int kc = K - k0 < kNibbleChunk ? K - k0 : kNibbleChunk;
    const int sp = span < kc ? span : kc;
    decode_nibble_chunk<Decode, Kind>(p, e, r0, R, rows, k0, kc, sp, a, scale, minv);
    for (int jp = 0; jp < pairs; ++jp) {
      const int j = 2 * jp;
      const bool two_tok = j + 1 < J;
      const int64_t b0 = int64_t(j) * S * 512, b1 = b0 + S * 512;
      for (int u0 = 0; u0 < kc; u0 += sp) {
        zero_c();
        tile_ksteps(a + u0, nullptr, kNibbleChunk * 2, 16 * kNibbleChunk, x_hi, x_lo, b0, b1, (k0 + u0) / 32, sp / 32,
                    two_rows, two_tok);
        save_c(part[0][0]);
        const float* sums = has_min(Decode) ? x_sum + int64_t((k0 + u0) / 32) * Tp + 16 * j : nullptr;
        add_scaled(acc[jp], part, scale[u0 / sp], has_min(Decode) ? minv[u0 / sp] : nullptr, sums,
                   sums ? sums + 16 : nullptr, two_rows, two_tok);
      }
    }
  }
  tile_release();
  for (int jp = 0; jp < pairs; ++jp) write_c(acc[jp], 2 * jp, J, R, T, c, ldc);
}

// A projection's code decoding and scale kind as compile-time values: with_nibble_kind(p, run) calls
// run(NibbleCase<Decode, Kind>{}), one list of the cases for both code tile GEMMs (CodeTiles: the bf16
// code tiles, which also take Q5_K; the digit GEMM does not, and takes Q6_K, which the code tiles do not).
template <int D, int S>
struct NibbleCase {
  static constexpr int decode = D, kind = S;
};
template <bool CodeTiles, typename Run>
void with_nibble_kind(const Proj& p, Run&& run) {
  if (p.method == kMXFP4) return run(NibbleCase<kNibbleE2M1, kScaleE8M0>{});
  if (p.method == kQ4_0) return run(NibbleCase<kNibbleQ4_0, kScaleF16>{});
  if (p.method == kQ4K) return run(NibbleCase<kNibbleQ4K, kScaleF16>{});
  if (p.method == kQ8_0) return run(NibbleCase<kByteQ8_0, kScaleF16>{});
  if constexpr (CodeTiles) {
    if (p.method == kQ5K) return run(NibbleCase<kNibbleQ5K, kScaleF16>{});
  } else {
    if (p.method == kQ6K) return run(NibbleCase<kSixBitQ6K, kScaleF16>{});
  }
  if (p.z) {
    if (p.scale_kind == kScaleF16) return run(NibbleCase<kNibbleZeros, kScaleF16>{});
    return run(NibbleCase<kNibbleZeros, kScaleBF16>{});
  }
  if (p.scale_kind == kScaleF16) return run(NibbleCase<kNibbleEight, kScaleF16>{});
  return run(NibbleCase<kNibbleEight, kScaleBF16>{});
}

void amx_gemm_nibble(const Proj& p, int e, int r0, int R, const uint16_t* x_hi, const uint16_t* x_lo, int T,
                     const float* x_sum, float* c, int ldc) {
  with_nibble_kind<true>(p, [&](auto k) {
    gemm_nibble_t<decltype(k)::decode, decltype(k)::kind>(p, e, r0, R, x_hi, x_lo, T, x_sum, c, ldc);
  });
}

// ---- int8 weights (one fp32 scale a row) on TDPBSSD ----
// The codes are A tiles as stored: 16 rows x 64 k of int8. Activations keep the int16-level accuracy
// of the AVX-512 GEMVs: q = round(x / d) with d = amax / 32639 per token, split exactly into two int8
// digits q = 256 * hi + lo (hi = (q + 128) >> 8, lo in [-128, 127]), and each digit is a B tile set
// ([token tile j][64-k step s]: 16 rows kq of 16 tokens x 4 bytes, B[kq][4n + i] = digit[n][4kq + i]).
// Two int32 accumulators, dot(w, hi) and dot(w, lo), are exact (|dot| <= 127 * 128 * K), and
// c = scale_r * d_t * (256 * hi_dot + lo_dot) rounds once in fp32.
constexpr float kDigitCodeMax = 32639.f;

// A token row's digit scale d = amax / 32639 (0 for a zero row; NaN for a row with a NaN or an Inf,
// whose outputs are then NaN), and in inv what its values are multiplied by. `next` (another row, or
// the same) is fetched meanwhile: an expert's tokens are scattered over the batch, and the scan of one
// stalled on its lines (perf, int4 layer at 512 tokens).
inline float digit_row_scale(const float* row, const float* next, int K, float& inv) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int k = 0; k < K; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(next + k), _MM_HINT_T0);
    const __m512 v = _mm512_loadu_ps(row + k);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const float amax = _mm512_reduce_max_ps(m);
  const bool bad = nan || amax > __FLT_MAX__;  // max_ps may pass over a NaN; an Inf's codes are meaningless
  // (a bad row's codes are clamped, defined, and then do not matter)
  inv = amax > 0.f ? kDigitCodeMax / amax : 0.f;
  return bad ? __builtin_nanf("") : amax > 0.f ? amax / kDigitCodeMax : 0.f;
}

// 64 values times inv as digits: q = round(v * inv) clamped to +-32639 (NaN to -32639), hi = (q + 128) >> 8,
// lo = q - 256 hi, each 64 bytes at hi64 / lo64 (64-byte aligned). The bytes come from saturating packs,
// exact here (every digit is within -128..127): 3 shuffles for 64 against 4 VPMOVDB of 2 each. The packs
// work per 128-bit lane (byte 16 l + 4 i + m holds element 4 l + m of vector i), so dword d of the k
// order is dword 4 (d % 4) + d / 4 of the packed.
inline void digit_step(const float* v64, float inv, int8_t* hi64, int8_t* lo64) {
  const __m512 scale = _mm512_set1_ps(inv), lim = _mm512_set1_ps(kDigitCodeMax);
  __m512i qh[4], ql[4];
  for (int i = 0; i < 4; ++i) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(v64 + 16 * i), scale);
    v = _mm512_max_ps(_mm512_min_ps(v, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));  // NaN -> -lim
    const __m512i q = _mm512_cvtps_epi32(v);  // round to nearest even
    qh[i] = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
    ql[i] = _mm512_sub_epi32(q, _mm512_slli_epi32(qh[i], 8));
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bh = _mm512_packs_epi16(_mm512_packs_epi32(qh[0], qh[1]), _mm512_packs_epi32(qh[2], qh[3]));
  const __m512i bl = _mm512_packs_epi16(_mm512_packs_epi32(ql[0], ql[1]), _mm512_packs_epi32(ql[2], ql[3]));
  _mm512_store_si512(hi64, _mm512_permutexvar_epi32(order, bh));
  _mm512_store_si512(lo64, _mm512_permutexvar_epi32(order, bl));
}

void amx_pack_i8(const float* const* a, int T, int K, int8_t* hi, int8_t* lo, float* d) {
  const int S = K / 64, J = (T + 15) / 16;
  alignas(64) int8_t rows_hi[16][64], rows_lo[16][64];
  for (int j = 0; j < J; ++j) {
    float inv[16];
    for (int n = 0; n < 16; ++n) {
      const int t = 16 * j + n;
      inv[n] = 0.f;
      d[t] = t < T ? digit_row_scale(a[t], a[t + 1 < T ? t + 1 : t], K, inv[n]) : 0.f;  // padding tokens: 0
    }
    for (int s = 0; s < S; ++s) {
      for (int n = 0; n < 16; ++n) {
        const int t = 16 * j + n;
        if (t >= T) {
          std::memset(rows_hi[n], 0, 64);
          std::memset(rows_lo[n], 0, 64);
          continue;
        }
        digit_step(a[t] + 64 * s, inv[n], rows_hi[n], rows_lo[n]);
      }
      // Token n's 16 dwords (4 digits each) to the tile's rows of 16 tokens, as amx_pack's pairs.
      store_transposed(rows_hi[0], hi + (int64_t(j) * S + s) * 1024);
      store_transposed(rows_lo[0], lo + (int64_t(j) * S + s) * 1024);
    }
  }
}

// One token row's digits, as amx_pack_i8 computes them, in k order: hi[k], lo[k] (64-byte aligned) and
// its scale *d. A batch's tokens quantized once (the MoE's phase 0), each expert then gathers its own
// (amx_tile_digit_rows): a token goes to top-k experts, which would each quantize it again.
void amx_digit_rows(const float* a, int K, int8_t* hi, int8_t* lo, float* d) {
  float inv = 0.f;
  *d = digit_row_scale(a, a, K, inv);
  for (int k = 0; k < K; k += 64) digit_step(a + k, inv, hi + k, lo + k);
}

// T tokens' digit rows (amx_digit_rows, 64-byte aligned) as amx_pack_i8's B tiles; tokens past T zero.
void amx_tile_digit_rows(const int8_t* const* hi_rows, const int8_t* const* lo_rows, int T, int K, int8_t* hi,
                         int8_t* lo) {
  const int S = K / 64, J = (T + 15) / 16;
  for (int j = 0; j < J; ++j) {
    for (int s = 0; s < S; ++s) {
      for (int part = 0; part < 2; ++part) {
        const int8_t* const* rows = part ? lo_rows : hi_rows;
        __m512i r[16];
        for (int n = 0; n < 16; ++n) {
          const int t = 16 * j + n;
          r[n] = t < T ? _mm512_load_si512(rows[t] + 64 * s) : _mm512_setzero_si512();
        }
        store_tile_transposed(r, (part ? lo : hi) + (int64_t(j) * S + s) * 1024);
      }
    }
  }
}

// Token tile j's int32 sums, the C tiles 0-3 as stored in acc (0/1: rows 0-15 / 16-31 of the sums
// weighing 256; 2/3: the same rows' sums weighing 1), to c[t * ldc + r] = row_scale[r] * x_scale[t] *
// (256 * hi + lo), rows clipped to R, tokens to T: both int8-digit GEMMs end this way.
inline void digit_sums_to_c(const int32_t (*acc)[16][16], const float* row_scale, const float* x_scale, bool two_rows,
                            int j, int R, int T, float* c, int ldc) {
  const __m512 dt = _mm512_loadu_ps(x_scale + 16 * j);
  for (int g = 0; g < (two_rows ? 2 : 1); ++g) {
    alignas(64) float out[16][16];
    for (int m = 0; m < 16; ++m) {
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc[g][m])), _mm512_set1_ps(256.f),
                                       _mm512_cvtepi32_ps(_mm512_load_si512(acc[g + 2][m])));
      _mm512_store_ps(out[m], _mm512_mul_ps(v, _mm512_mul_ps(dt, _mm512_set1_ps(row_scale[16 * g + m]))));
    }
    store_c(out, 16 * g, R, 16 * j, T, c, ldc);
  }
}
inline void store_digit_tiles(int32_t (*acc)[16][16], bool two_rows) {
  TILE_STORE(0, acc[0], 64);
  TILE_STORE(2, acc[2], 64);
  if (two_rows) {
    TILE_STORE(1, acc[1], 64);
    TILE_STORE(3, acc[3], 64);
  }
}

// The lines of c that token tile j's sums go to, fetched for writing while its tiles run: c is a
// batch-wide array (the intermediate, the expert outputs) whose token rows are far apart.
inline void prefetch_c_lines(float* c, int ldc, int j, int T, bool two_rows) {
  for (int n = 0; n < 16 && 16 * j + n < T; ++n) {
    const char* row = reinterpret_cast<const char*>(c + int64_t(16 * j + n) * ldc);
    _mm_prefetch(row, _MM_HINT_ET0);
    _mm_prefetch(row + 60, _MM_HINT_ET0);  // rows 0-15 may straddle two lines
    if (two_rows) _mm_prefetch(row + 124, _MM_HINT_ET0);
  }
}

// Token tile j's sums from the four C tiles to c. Stored by j's products and converted while token
// tile j + 1's run (step 1 of its loop), so that the tiles do not wait on the conversion and c's
// stores (in-process on the AMX Xeon, the int4 layer at 512 tokens: ~1.5 ms of 75): the caller
// keeps two sets of accumulators, acc[j & 1].
struct DeferredSums {
  alignas(64) int32_t acc[2][4][16][16];  // left uninitialized: each set is stored before it is read
  const float* row_scale;
  const float* x_scale;
  bool two_rows;
  int R, T, ldc;
  float* c;
  int pending = -1;  // the token tile whose sums wait in acc[pending & 1]

  DeferredSums(const float* row_scale_, const float* x_scale_, bool two_rows_, int R_, int T_, float* c_, int ldc_)
      : row_scale(row_scale_), x_scale(x_scale_), two_rows(two_rows_), R(R_), T(T_), ldc(ldc_), c(c_) {}

  void flush() {
    if (pending >= 0) digit_sums_to_c(acc[pending & 1], row_scale, x_scale, two_rows, pending, R, T, c, ldc);
    pending = -1;
  }
  void store(int j) {  // after j's products: the tiles to acc[j & 1]
    store_digit_tiles(acc[j & 1], two_rows);
    flush();  // j - 1's, where j's loop was too short to take it
    pending = j;
  }
};

// Tiles 0/1: rows 0-15 / 16-31 against hi digits, 2/3 the same against lo; A rows in 4/5, B in 6/7.
// c[t * ldc + r] for r < R (<= 32), t < T; w rows w_stride bytes apart, 16 * ceil(R / 16) readable.
void amx_gemm_i8(const int8_t* w, int64_t w_stride, const float* w_scale, int R, int K, const int8_t* x_hi,
                 const int8_t* x_lo, const float* x_scale, int T, float* c, int ldc) {
  configure_tiles();
  const int S = K / 64, J = (T + 15) / 16;
  const bool two_rows = R > 16;
  alignas(64) float row_scale[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) row_scale[r] = r < R ? w_scale[r] : 0.f;
  DeferredSums sums(row_scale, x_scale, two_rows, R, T, c, ldc);
  for (int j = 0; j < J; ++j) {
    const int64_t b0 = int64_t(j) * S * 1024;
    zero_c();
    prefetch_c_lines(c, ldc, j, T, two_rows);
    for (int s = 0; s < S; ++s) {
      TILE_LOAD(4, w + 64 * s, w_stride);
      if (two_rows) TILE_LOAD(5, w + 16 * w_stride + 64 * s, w_stride);
      TILE_LOAD(6, x_hi + b0 + int64_t(s) * 1024, 64);
      TILE_LOAD(7, x_lo + b0 + int64_t(s) * 1024, 64);
      TILE_DPBSSD(0, 4, 6);
      TILE_DPBSSD(2, 4, 7);
      if (two_rows) {
        TILE_DPBSSD(1, 5, 6);
        TILE_DPBSSD(3, 5, 7);
      }
      if (s == 1) sums.flush();
    }
    sums.store(j);
  }
  sums.flush();
  tile_release();
}

// ---- 4-bit rows on int8 tiles (int4 sym/asym, gptq, GGUF Q4_0, Q4_K, mxfp4), Q6_K's and Q8_0's: two weight digits ----
// The bf16 path above applies each group's scale after that group's tile products: at groups of 32, a
// C tile store and a multiply-add per C row every 32 k, as long as the products themselves. Here the
// scales go into the weights before the tiles: a row's weights w = s_g * v (v the code value) become
// integers q ~ w / U on one unit U for the whole row, |q| <= 32639, split exactly into two int8 digits
// q = 256 * hi + lo as the activations are (amx_pack_i8). The row's dot products are then exact int32
// sums over all of K with nothing per group, and c = 256 U d_t (256 hh + mid) rounds in fp32 at the
// end: per 64-k step three TDPBSSD (w_hi x_hi into hh; w_hi x_lo and w_lo x_hi both into mid, they
// weigh the same), against the bf16 path's four TDPBF16PS (two 32-k steps of x_hi and x_lo) and two
// group steps. The dropped w_lo x_lo is at most 2^14 units of U d_t a product.
// q: v << shift as an int16 word (a table lookup; shift 12 where |v| <= 8, 11 where |v| <= 16) times
// b_g = round(32639 s_g / s_max) (s_max: the row's largest |scale|) by VPMULHRSW, which rounds
// (v << shift) b_g / 2^15 to an integer: q = round(v b_g 2^(shift - 15)), U = W / 32639 with
// W = s_max 2^(15 - shift) >= the row's largest |w|. b_g's rounding moves q by at most
// |v| 2^(shift - 15) / 2 <= 1/2 and VPMULHRSW's by 1/2: |q U - w| <= U. A dot product's error is then
// at most sum_k (|x_k| W / 32639 + |w_k| amax_t / 65278) + K 2^14 W amax_t / 32639^2 (activations'
// half unit, the dropped term), ~6e-5 of K W amax_t at most: the int16 level of the AVX-512 GEMVs.
// Q8_0's int8 codes (|v| <= 128) go in as v << 8, which VPMULHRSW by b_g turns into round(v b_g / 128);
// Q6_K's code - 32 (|v| <= 32) as v << 10, round(v b_g / 32).
constexpr int digit_shift(int decode) {
  return decode == kByteQ8_0    ? 8
         : decode == kSixBitQ6K ? 10
         : decode == kNibbleEight || decode == kNibbleQ4_0 ? 12
                                                          : 11;
}

// v << shift by table index: the code itself (code - 8; twice an E2M1 value), or for codes with zero
// points code + 16 - zero (nibble_value's indices).
template <int Decode>
inline __m512i digit_table() {
  constexpr bool minus8 = Decode == kNibbleEight || Decode == kNibbleQ4_0;
  alignas(64) int16_t t[32];
  for (int i = 0; i < 32; ++i)
    t[i] = minus8 && i >= 16 ? 0 : int16_t(nibble_value(Decode, minus8 ? i + 8 : i) * (1 << digit_shift(Decode)));
  return _mm512_load_si512(t);
}

// A row's scales as fp32, one a step of its blocks (Q4_0, Q8_0: each block's d; Q6_K: d * sc of each 16;
// the others: each group's) into sc[G].
template <int Decode, int Kind>
inline void digit_row_scales(const uint8_t* row, const uint8_t* s, int G, float* sc) {
  int g = 0;
  if constexpr (Decode == kSixBitQ6K) {  // a superblock: ql[128], qh[64], 16 int8 scales, fp16 d (210 bytes)
    for (; g < G; g += 16) {
      const uint8_t* sb = row + int64_t(g / 16) * 210;
      const __m512 sc16 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192))));
      _mm512_storeu_ps(sc + g, _mm512_mul_ps(sc16, _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(sb + 208)))));
    }
  } else if constexpr (Decode == kNibbleQ4_0 || Decode == kByteQ8_0) {
    constexpr int block = Decode == kNibbleQ4_0 ? 18 : 34;
    for (; g < G; ++g) sc[g] = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(row + int64_t(g) * block));
  } else if constexpr (Kind == kScaleBF16 || Kind == kScaleF16) {
    for (; g + 16 <= G; g += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * g));
      const __m512 bf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm512_storeu_ps(sc + g, Kind == kScaleF16 ? _mm512_cvtph_ps(h) : bf);
    }
  }
  for (; g < G; ++g) sc[g] = nibble_scale<Kind>(s, g);
}

// A 64-weight step's codes as byte indices into its step table (digit_step_table): 2 code + 32 h for
// the code of k + 32 h + i at byte i of half h, in k order. VPMULTISHIFTQB picks 8 bits of a qword
// from any bit offset, so one instruction moves each nibble to bits 1-4 of its byte (offset 4n - 1
// for the nibble n bits up; offset -1 wraps to bit 63, zero or a neighbour nibble's bit, masked off).
// kCodesInterleaved (int4, mxfp4): byte i holds k 2i (low nibble) and 2i + 1 (high); 4 bytes a qword
// (VPMOVZXDQ) give its 8 indices. kCodesBlockHalves (Q4_0): a block's 16 bytes hold k 0-15 (low
// nibbles) and 16-31 (high), so each block fills two 128-bit lanes, low nibbles picked in the first,
// high in the second. kCodesChunkHalves (Q4_K): 32 bytes hold k 0-31 (low nibbles) and 32-63 (high),
// in both 256-bit halves, low nibbles picked in the first, high in the second.
enum CodeLayout : int { kCodesInterleaved, kCodesBlockHalves, kCodesChunkHalves };
template <int Decode>
constexpr int code_layout() {
  return Decode == kNibbleQ4_0 ? kCodesBlockHalves : Decode == kNibbleQ4K ? kCodesChunkHalves : kCodesInterleaved;
}
template <int Layout>
inline __m512i digit_step_index(const uint8_t* codes, const uint8_t* codes_b) {
  // a qword's 8 bit offsets, byte 0 first: 4 interleaved bytes (63, 3, 7, ..., 27); 8 bytes' low
  // nibbles (63, 7, 15, ..., 55) or high nibbles (3, 11, ..., 59)
  const long long interleaved = 0x1B17130F0B07033F, low = 0x372F271F170F073F, high = 0x3B332B231B130B03;
  __m512i x, ctrl;
  if constexpr (Layout == kCodesBlockHalves) {
    x = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    x = _mm512_mask_broadcast_i32x4(x, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes_b)));
    ctrl = _mm512_set_epi64(high, high, low, low, high, high, low, low);
  } else if constexpr (Layout == kCodesChunkHalves) {
    x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    ctrl = _mm512_set_epi64(high, high, high, high, low, low, low, low);
  } else {
    x = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    ctrl = _mm512_set1_epi64(interleaved);
  }
  const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi8(32), 1);
  // (bits & 0x1E) | 32 h
  return _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(ctrl, x), _mm512_set1_epi8(0x1E), half, 0xEA);
}

// The 32 int16 words q = VPMULHRSW(table value, b_g) of a 64-weight step's 16 codes in each half (words
// 0-15: the group of k, 16-31: the group of k + 32; at groups of 64 or more the same one twice) as
// (q + 128) ^ 0x80: its low byte is q & 255 (adding 128 flips bit 7 and carries into the high byte),
// the lo digit; its high byte is (q + 128) >> 8, the hi digit. base: the table values of the 16 codes
// in each half; bb: b_g in both words of a dword, for each group.
inline __m512i digit_words(__m512i q) {
  return _mm512_xor_si512(_mm512_add_epi16(q, _mm512_set1_epi16(128)), _mm512_set1_epi16(0x80));
}
inline __m512i digit_step_table(__m512i base, const int32_t* bb, int g0, int g1) {
  const __m512i b = _mm512_mask_set1_epi32(_mm512_set1_epi32(bb[g0]), 0xFF00, bb[g1]);
  return digit_words(_mm512_mulhrs_epi16(base, b));
}

// Byte i: 2 i, the VPERMT2B index of word i's low byte across two vectors.
inline __m512i even_byte_index() {
  alignas(64) int8_t t[64];
  for (int i = 0; i < 64; ++i) t[i] = int8_t(2 * i);
  return _mm512_load_si512(t);
}
// A step's 64 digit words (digit_words: 32 in q0, 32 in q1, k order) as its 64 lo digits (even bytes)
// and 64 hi digits (odd bytes); even: even_byte_index().
inline void store_step_digits(__m512i q0, __m512i q1, __m512i even, int8_t* lo, int8_t* hi) {
  _mm512_storeu_si512(lo, _mm512_permutex2var_epi8(q0, even, q1));
  _mm512_storeu_si512(hi, _mm512_permutex2var_epi8(q0, _mm512_or_si512(even, _mm512_set1_epi8(1)), q1));
}
// A Q8_0 step: two blocks' 32 int8 codes each (at `block` and block + 34, after their fp16 d) as the
// words q = VPMULHRSW(v << 8, b_g) = round(v b_g / 128), split by two VPERMT2B into the 64 lo digits
// (even bytes of digit_words) and the 64 hi digits (odd bytes) in k order.
inline void q8_0_step_digits(const uint8_t* block, const int32_t* bb, int g, __m512i even, int8_t* lo, int8_t* hi) {
  const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)));
  const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 36)));
  const __m512i q0 = digit_words(_mm512_mulhrs_epi16(_mm512_slli_epi16(v0, 8), _mm512_set1_epi32(bb[g])));
  const __m512i q1 = digit_words(_mm512_mulhrs_epi16(_mm512_slli_epi16(v1, 8), _mm512_set1_epi32(bb[g + 1])));
  store_step_digits(q0, q1, even, lo, hi);
}
// A Q6_K step: 64 codes in k order (two vectors of 32 from q6k_codes, 16-weight groups g .. g + 3) as
// the words q = VPMULHRSW((code - 32) << 10, b_g) = round((code - 32) b_g / 32), split as Q8_0's.
inline void q6k_step_digits(__m256i c0, __m256i c1, const int32_t* bb, int g, __m512i even, int8_t* lo, int8_t* hi) {
  const auto words = [&](__m256i c, int g2) {
    const __m512i v = _mm512_slli_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(c), _mm512_set1_epi16(32)), 10);
    const __m512i b = _mm512_mask_set1_epi32(_mm512_set1_epi32(bb[g2]), 0xFF00, bb[g2 + 1]);  // words 16-31: g2 + 1
    return digit_words(_mm512_mulhrs_epi16(v, b));
  };
  store_step_digits(words(c0, g), words(c1, g + 2), even, lo, hi);
}

// Q4_K rows on the digit grid. A weight is w = s_g c - m_g (s_g = d sc_g and m_g = dmin m_g, both exact
// in fp32; c in [0, 15]) for its sub-block g of 32, so a step's table holds its two sub-blocks' 16
// values each, min included: q = round(c s'_g + m'_g) with s' = s_g / U, m' = -m_g / U, U = W / 32639,
// W = max_g max(|m_g|, |15 s_g - m_g|) >= the row's every |w|. s' and m' round to fp32 (2^-24 of at most
// 32639 each) and the FMA once, so |q U - w| <= U / 2 + 0.01 U: within one unit, as the other formats.
// The sub-blocks' scales into s[g] = s'_g and m[g] = m'_g; returns U (NaN for a row whose d or dmin is
// not finite, whose tables are then zero).
inline float q4k_digit_row(const uint8_t* row, int G, float* s, float* m) {
  __m256 reach = _mm256_setzero_ps();
  bool bad = false;
  for (int b = 0; b < G / 8; ++b) {
    const uint8_t* sb = row + int64_t(b) * 144;
    uint16_t d16, m16;
    std::memcpy(&d16, sb, 2);
    std::memcpy(&m16, sb + 2, 2);
    const float d = _cvtsh_ss(d16), dmin = _cvtsh_ss(m16);
    bad |= !std::isfinite(d) || !std::isfinite(dmin);
    __m256 sc, mn;
    k4_scales_mins(sb + 4, &sc, &mn);
    sc = _mm256_mul_ps(sc, _mm256_set1_ps(d));
    mn = _mm256_mul_ps(mn, _mm256_set1_ps(dmin));
    _mm256_storeu_ps(s + 8 * b, sc);
    _mm256_storeu_ps(m + 8 * b, mn);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 top = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(15.f), sc), mn);  // code 15
    reach = _mm256_max_ps(reach, _mm256_max_ps(_mm256_and_ps(mn, abs_mask), _mm256_and_ps(top, abs_mask)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, reach);
  float wmax = 0.f;
  for (float v : lanes) wmax = std::max(wmax, v);
  const float inv = wmax > 0.f ? kDigitCodeMax / wmax : 0.f;
  for (int g = 0; g < G; ++g) {  // inv = 0 for a bad row: its tables are zero
    s[g] = bad ? 0.f : s[g] * inv;
    m[g] = bad ? 0.f : m[g] * -inv;
  }
  return bad ? __builtin_nanf("") : wmax / kDigitCodeMax;
}
// A step's table (words 0-15: sub-block g, 16-31: g + 1) from q4k_digit_row's s' and m'. VPACKSSDW
// takes four dwords of each source a 128-bit lane, so the sources hold codes {0-3, 8-11} and {4-7,
// 12-15} of each sub-block and the words come out in code order.
inline __m512i q4k_step_table(const float* s, const float* m, int g) {
  const __m512 cx = _mm512_setr_ps(0, 1, 2, 3, 8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11);
  const __m512 cy = _mm512_add_ps(cx, _mm512_set1_ps(4.f));
  const __m512 sv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(s[g]), 0xFF00, _mm_load_ss(s + g + 1));
  const __m512 mv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(m[g]), 0xFF00, _mm_load_ss(m + g + 1));
  return digit_words(_mm512_packs_epi32(_mm512_cvtps_epi32(_mm512_fmadd_ps(cx, sv, mv)),
                                        _mm512_cvtps_epi32(_mm512_fmadd_ps(cy, sv, mv))));
}

// The decode's per-thread scratch: a row's group scales (Q4_K: s') and Q4_K's m'; b_g (kNibbleZeros:
// 16 - zero_g) in both words of a dword.
struct DigitScratch {
  std::vector<float> sc, mins;
  std::vector<int32_t> bb, zz;
};
// Rows [n0, n1) of expert e as digits, a_hi/a_lo[i * K + k] for row n0 + i, and unit[i] = U. A row with
// a NaN or infinite scale (which the loaders refuse: formats/base.py) gets a NaN unit and zero digits.
// Each 64-weight step computes its 32 codes' q once (a table of 2 x 16 words, digit_step_table) rather
// than each weight's, and two VPERMB look up every weight's lo and hi digits in it. (perf on the int4
// layer at 512 tokens: the per-weight VPMULHRSW, packs and lane fixes were half of the kernel's samples.
// Decoding a step of all 32 rows at a time, one step ahead of the tiles that read it, measured slower,
// padded off K's power-of-two row stride or not: docs/benchmarks.md.)
template <int Decode, int Kind>
void decode_digit_rows(const Proj& p, int e, int n0, int n1, int8_t* a_hi, int8_t* a_lo, float* unit,
                       DigitScratch& ds) {
  const int K = p.k;
  // scales inside the blocks: one a block (sub-block) of 32, Q6_K's one a 16
  constexpr bool inner_scales = Decode == kNibbleQ4_0 || Decode == kNibbleQ4K || Decode == kByteQ8_0 || Decode == kSixBitQ6K;
  const int step = Decode == kSixBitQ6K ? 16 : inner_scales ? 32 : p.group, G = (K + step - 1) / step;
  const int gshift = __builtin_ctz(unsigned(step));  // groups: 32 times powers of two (bindings.cpp)
  static const __m512i table = digit_table<Decode>();
  // word i of a step's base: code i & 15's table value (kNibbleZeros: index code + 16 - zero, per half)
  const __m512i codes16 = _mm512_and_si512(
      _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                       7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi16(15));
  static const __m512i base_fixed = _mm512_permutexvar_epi16(codes16, table);
  static const __m512i even = even_byte_index();  // the byte-coded steps' digit split (store_step_digits)
  const int64_t row_bytes = Decode == kNibbleQ4_0   ? int64_t(K / 32) * 18
                            : Decode == kByteQ8_0  ? int64_t(K / 32) * 34
                            : Decode == kSixBitQ6K ? int64_t(K / 256) * 210
                            : Decode == kNibbleQ4K ? int64_t(K / 256) * 144
                                                   : K / 2;
  std::vector<float>&sc = ds.sc, &mins = ds.mins;
  std::vector<int32_t>&bb = ds.bb, &zz = ds.zz;
  if (sc.size() < size_t(G) + 16) {
    for (auto* v : {&sc, &mins}) v->resize(G + 16);
    for (auto* v : {&bb, &zz}) v->resize(G + 16);
  }
  for (int r = 0; r < n1 - n0; ++r) {
    int8_t* hi = a_hi + int64_t(r) * K;
    int8_t* lo = a_lo + int64_t(r) * K;
    const int n = n0 + r;
    const uint8_t* row = p.w + e * p.w_estride + int64_t(n) * p.w_rstride;
    const uint8_t* s = inner_scales ? nullptr : p.s + e * p.s_estride + int64_t(n / p.s_row_div) * p.s_rstride;
    const uint8_t* z = Decode == kNibbleZeros ? p.z + e * p.z_estride + int64_t(n) * p.z_rstride : nullptr;
    // this row of the block after (DigitRowsAhead decodes a block while the tiles of the one before run)
    // Q8_0's 34 lines a row (K = 2048) in one burst stalled on the line fill buffers: its step loop
    // asks for them a step at a time (Qwen3 layer at 512 tokens: 97.9-98.9 -> 89.2-96.1 ms; int4's 16
    // lines and Q4_0's 18 were as fast or faster in one burst).
    if constexpr (Decode != kByteQ8_0) prefetch_lines(row + kAmxRows * p.w_rstride, row_bytes);
    if constexpr (Decode == kNibbleQ4K) {
      unit[r] = q4k_digit_row(row, G, sc.data(), mins.data());
    } else {
      // b_g = round(32639 s_g / s_max) for every group, s_max over the row (NaN or Inf: the row is bad).
      // The scales 16 groups at a time: 16-bit ones straight from their words, twice, the others
      // (Q4_0's inside its blocks, e8m0) through sc. (The store of the scales and their masked reload
      // stalled each row's setup: perf, int4 layer at 512 tokens; in-process ~2 ms of 73.)
      constexpr bool direct = !inner_scales && (Kind == kScaleBF16 || Kind == kScaleF16);
      if constexpr (!direct) digit_row_scales<Decode, Kind>(row, s, G, sc.data());
      const auto scales = [&](int g, __mmask16 m) {
        if constexpr (!direct) return _mm512_maskz_loadu_ps(m, sc.data() + g);
        const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(s) + g);
        if constexpr (Kind == kScaleF16) return _mm512_cvtph_ps(h);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      };
      __m512 vmax = _mm512_setzero_ps();
      __mmask16 bad = 0;
      for (int g = 0; g < G; g += 16) {
        const __mmask16 m = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
        const __m512 a = _mm512_abs_ps(scales(g, m));
        bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(__FLT_MAX__), _CMP_NLE_UQ);  // NaN or Inf
        vmax = _mm512_max_ps(vmax, a);
      }
      const float smax = bad ? 0.f : _mm512_reduce_max_ps(vmax);
      const __m512 inv = _mm512_set1_ps(smax > 0.f ? kDigitCodeMax / smax : 0.f);
      unit[r] = bad ? __builtin_nanf("") : smax * float(1 << (15 - digit_shift(Decode))) / kDigitCodeMax;
      for (int g = 0; g < G; g += 16) {  // |b_g| <= 32639; rounded to nearest even as lrintf would
        const __mmask16 m = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(scales(g, m), inv));
        const __m512i word = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF));
        _mm512_mask_storeu_epi32(bb.data() + g, m, _mm512_or_si512(_mm512_slli_epi32(word, 16), word));
        if constexpr (Decode == kNibbleZeros) {
          const __m512i off = _mm512_sub_epi32(_mm512_set1_epi32(16), _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, z + g)));
          _mm512_mask_storeu_epi32(zz.data() + g, m, _mm512_or_si512(_mm512_slli_epi32(off, 16), off));
        }
      }
    }
    if constexpr (Decode == kByteQ8_0) {
      const uint8_t* next = row + kAmxRows * p.w_rstride;
      for (int k = 0; k < K; k += 64) {
        prefetch_lines(next + int64_t(k / 32) * 34, 68);
        q8_0_step_digits(row + int64_t(k / 32) * 34, bb.data(), k / 32, even, lo + k, hi + k);
      }
      continue;
    }
    if constexpr (Decode == kSixBitQ6K) {
      for (int k = 0; k < K; k += 128) {  // a half superblock: two steps
        const uint8_t* sb = row + int64_t(k / 256) * 210;
        const int half = (k % 256) / 128;
        __m256i c[4];
        q6k_codes(sb + 64 * half, sb + 128 + 32 * half, c);
        q6k_step_digits(c[0], c[1], bb.data(), k / 16, even, lo + k, hi + k);
        q6k_step_digits(c[2], c[3], bb.data(), k / 16 + 4, even, lo + k + 64, hi + k + 64);
      }
      continue;
    }
    for (int k = 0; k < K; k += 64) {
      const int g0 = k >> gshift, g1 = (k + 32) >> gshift;
      __m512i t;
      if constexpr (Decode == kNibbleQ4K) {
        t = q4k_step_table(sc.data(), mins.data(), g0);
      } else {
        __m512i base = base_fixed;
        if constexpr (Decode == kNibbleZeros)
          base = _mm512_permutexvar_epi16(
              _mm512_add_epi16(codes16, _mm512_mask_set1_epi32(_mm512_set1_epi32(zz[g0]), 0xFF00, zz[g1])), table);
        t = digit_step_table(base, bb.data(), g0, g1);
      }
      const uint8_t* codes = Decode == kNibbleQ4_0 ? row + int64_t(k / 32) * 18 + 2
                             : Decode == kNibbleQ4K ? row + int64_t(k / 256) * 144 + 16 + (k % 256) / 2
                                                    : row + k / 2;
      const __m512i idx = digit_step_index<code_layout<Decode>()>(codes, codes + 18);
      _mm512_storeu_si512(lo + k, _mm512_permutexvar_epi8(idx, t));
      _mm512_storeu_si512(hi + k, _mm512_permutexvar_epi8(_mm512_or_si512(idx, _mm512_set1_epi8(1)), t));
    }
  }
}

// A thread's digit rows for the block its tiles read and for the block after, which it decodes
// meanwhile (`next` of amx_gemm_digits): the decode's vector ops and the tile unit's products run at
// once. A block decoded ahead is used only by the thread's very next call, and only where that call
// names the same block: the same projection object (the callers pass the one they call with), expert
// and rows.
struct DigitBlocks {
  std::vector<int8_t> mem[2];
  alignas(64) float unit[2][kAmxRows];
  int ahead = -1;  // the buffer holding `block`'s rows, decoded for this thread's next call; -1: none
  RowBlock block;
  DigitScratch scratch;

  // Buffer i's hi digits (kAmxRows rows of K in k order, 64-byte aligned), the lo digits kAmxRows * K
  // after them. (The A tiles' own layout, each tile's 1 KB in one piece, made the tile loop faster
  // and the decode's stores slower: the layer no faster, AMX Xeon.)
  int8_t* rows(int i, int K) {
    if (mem[i].size() < size_t(2) * kAmxRows * K + 64) mem[i].resize(size_t(2) * kAmxRows * K + 64);
    return reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(mem[i].data()) + 63) & ~uintptr_t(63));
  }
};
thread_local DigitBlocks tl_digits;

// A block's rows decoded into digit buffer `buf` a few at a time (run_to): the next block's between the
// tiles of the current one, or, where nothing was decoded ahead, the current block's all at once.
struct DigitRowsAhead {
  using RowsFn = void (*)(const Proj&, int, int, int, int8_t*, int8_t*, float*, DigitScratch&);
  RowBlock block;
  RowsFn rows_fn = nullptr;  // decode_digit_rows of the block's decoding and scale kind
  int8_t *hi = nullptr, *lo = nullptr;
  float* unit = nullptr;
  DigitScratch* scratch = nullptr;
  int done = 0;

  DigitRowsAhead(DigitBlocks& db, int buf, const RowBlock* next) {
    if (!next) return;
    block = *next;
    with_nibble_kind<false>(*block.p, [&](auto k) {
      rows_fn = &decode_digit_rows<decltype(k)::decode, decltype(k)::kind>;
    });
    const int K = block.p->k, rows = block.R > 16 ? kAmxRows : 16;
    hi = db.rows(buf, K);
    lo = hi + int64_t(kAmxRows) * K;
    unit = db.unit[buf];
    scratch = &db.scratch;
    for (int r = block.R; r < rows; ++r) {  // the A tiles' rows past R read zeros
      std::memset(hi + int64_t(r) * K, 0, K);
      std::memset(lo + int64_t(r) * K, 0, K);
      unit[r] = 0.f;
    }
  }
  // The block's rows up to n (<= block.R) decoded.
  void run_to(int n) {
    if (n <= done) return;
    const int K = block.p->k;
    const int64_t off = int64_t(done) * K;
    rows_fn(*block.p, block.e, block.r0 + done, block.r0 + n, hi + off, lo + off, unit + done, *scratch);
    done = n;
  }
};

// Tiles 0/1: rows 0-15 / 16-31, w_hi x_hi; 2/3: the same rows, w_hi x_lo + w_lo x_hi; A digits in 4/5
// (hi, lo; the second row group's reloaded into them), B digits in 6/7 (hi, lo). The rows of `next`
// are decoded between the tile products, spread evenly over the J * S steps.
void amx_gemm_digits(const Proj& p, int e, int r0, int R, const int8_t* x_hi, const int8_t* x_lo, const float* x_scale,
                     int T, float* c, int ldc, const RowBlock* next) {
  const int K = p.k, S = K / 64, J = (T + 15) / 16;
  const bool two_rows = R > 16;
  const int rows = two_rows ? 32 : 16;
  DigitBlocks& db = tl_digits;
  const RowBlock self{&p, e, r0, R};
  int cur = 0;
  const RowBlock& b = db.block;
  if (db.ahead >= 0 && b.p == &p && b.e == e && b.r0 == r0 && b.R == R) {
    cur = db.ahead;
  } else {
    DigitRowsAhead now(db, cur, &self);
    now.run_to(R);
  }
  db.ahead = -1;
  const int8_t* a_hi = db.rows(cur, K);
  const int8_t* a_lo = a_hi + int64_t(kAmxRows) * K;
  alignas(64) float row_scale[kAmxRows];
  // the products weigh 65536 (hi x hi) and 256 (the mid sums): 256 U times 256 hh + mid
  for (int r = 0; r < kAmxRows; ++r) row_scale[r] = r < rows ? 256.f * db.unit[cur][r] : 0.f;
  DigitRowsAhead ahead(db, 1 - cur, next);
  const int steps = J * S;
  configure_tiles();
  DeferredSums sums(row_scale, x_scale, two_rows, R, T, c, ldc);
  for (int j = 0; j < J; ++j) {
    const int64_t b0 = int64_t(j) * S * 1024;
    zero_c();
    prefetch_c_lines(c, ldc, j, T, two_rows);
    for (int s = 0; s < S; ++s) {
      TILE_LOAD(6, x_hi + b0 + int64_t(s) * 1024, 64);
      TILE_LOAD(7, x_lo + b0 + int64_t(s) * 1024, 64);
      TILE_LOAD(4, a_hi + 64 * s, K);
      TILE_LOAD(5, a_lo + 64 * s, K);
      TILE_DPBSSD(0, 4, 6);
      TILE_DPBSSD(2, 4, 7);
      TILE_DPBSSD(2, 5, 6);
      if (two_rows) {
        TILE_LOAD(4, a_hi + 16 * K + 64 * s, K);
        TILE_LOAD(5, a_lo + 16 * K + 64 * s, K);
        TILE_DPBSSD(1, 4, 6);
        TILE_DPBSSD(3, 4, 7);
        TILE_DPBSSD(3, 5, 6);
      }
      if (s == 1) sums.flush();
      ahead.run_to(int(int64_t(j * S + s + 1) * ahead.block.R / steps));  // none where nothing is next
    }
    sums.store(j);
  }
  sums.flush();
  tile_release();
  if (next) {
    db.block = *next;
    db.ahead = 1 - cur;
  }
}

KernelTable make_table() {
  KernelTable t = *avx512_kernels();
#ifdef HETMOE_AMX_EMULATED
  t.name = "amx-emu";
#else
  t.name = "amx";
#endif
  t.amx_pack = amx_pack;
  t.amx_split = amx_split;
  t.amx_gemm = amx_gemm;
  t.amx_pack_i8 = amx_pack_i8;
  t.amx_digit_rows = amx_digit_rows;
  t.amx_tile_digit_rows = amx_tile_digit_rows;
  t.amx_gemm_i8 = amx_gemm_i8;
  t.amx_gemm_nibble = amx_gemm_nibble;
  t.amx_gemm_digits = amx_gemm_digits;
  return t;
}

}  // namespace

#ifdef HETMOE_AMX_EMULATED
const KernelTable* amx_emu_kernels() {
#else
const KernelTable* amx_kernels() {
#endif
  static const KernelTable table = make_table();
  return &table;
}

}  // namespace hetmoe
