// AMX-BF16 variant: the AVX-512 kernels, with the prefill GEMM on tiles (TDPBF16PS).
// Compiled with -mamx-tile -mamx-bf16 -mamx-int8 plus the AVX-512 flags (setup.py); selected only
// where CPUID reports AMX and the kernel granted this process tile data (cpu_features.cpp).
//
// C[t][r] = sum_k a[t][k] * panel[r][k] as 16x16 fp32 tiles: A = 16 tokens x 32 k (bf16),
// B = the panel block transposed into AMX's pair layout, B[k/2][2r + k%2] = panel[r][k].
// Operands are rounded to bf16 (round to nearest even); accumulation stays fp32.
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

namespace hetmoe {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline uint16_t to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 16 fp32 -> 16 bf16, round to nearest even (finite inputs).
inline __m256i to_bf16x16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

void gemm_panel_amx(const float* panel, int R, int K, const float* const* a, int T, float* c, int ldc) {
  TileConfig cfg;
  for (int i = 0; i < 3; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t A[16][32];
  alignas(64) uint16_t B[16][32];
  alignas(64) float C[16][16];
  for (int r0 = 0; r0 < R; r0 += 16) {
    const int nr = R - r0 < 16 ? R - r0 : 16;
    for (int t0 = 0; t0 < T; t0 += 16) {
      const int nt = T - t0 < 16 ? T - t0 : 16;
      _tile_zero(0);
      for (int k0 = 0; k0 < K; k0 += 32) {
        for (int t = 0; t < 16; ++t) {
          if (t < nt) {
            const float* src = a[t0 + t] + k0;
            _mm256_store_si256(reinterpret_cast<__m256i*>(&A[t][0]), to_bf16x16(_mm512_loadu_ps(src)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(&A[t][16]), to_bf16x16(_mm512_loadu_ps(src + 16)));
          } else {
            _mm512_store_si512(&A[t][0], _mm512_setzero_si512());
          }
        }
        for (int kk = 0; kk < 32; kk += 2)
          for (int r = 0; r < 16; ++r) {
            const float* row = panel + int64_t(r0 + r) * K + k0 + kk;
            B[kk / 2][2 * r] = r < nr ? to_bf16(row[0]) : 0;
            B[kk / 2][2 * r + 1] = r < nr ? to_bf16(row[1]) : 0;
          }
        _tile_loadd(1, A, 64);
        _tile_loadd(2, B, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, C, 64);
      for (int t = 0; t < nt; ++t)
        for (int r = 0; r < nr; ++r) c[(t0 + t) * ldc + r0 + r] = C[t][r];
    }
  }
  _tile_release();
}

KernelTable make_table() {
  KernelTable t = *avx512_kernels();
  t.name = "amx";
  t.gemm_panel = gemm_panel_amx;
  return t;
}

}  // namespace

const KernelTable* amx_kernels() {
  static const KernelTable table = make_table();
  return &table;
}

}  // namespace hetmoe
