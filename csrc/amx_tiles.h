// The AMX tile operations the AMX kernels use, as one small vocabulary with two definitions:
//
// - the hardware's (HETMOE_AMX_EMULATED undefined): the compiler's intrinsics, in the unit built with
//   -mamx-tile -mamx-bf16 (kernels_amx.cpp);
// - a scalar emulator (HETMOE_AMX_EMULATED defined): eight 1 KiB tiles and a configuration per
//   thread, each operation written from the Intel SDM's pseudo-code (TDPBF16PS: two fp32
//   accumulators a row element, one for the even and one for the odd bf16 of each pair, each a
//   chain of FMAs with DAZ/FTZ and round-to-nearest-even, summed once and added to the destination,
//   itself read with DAZ). Probed on a Xeon with AMX (family 6 model 207): bit for bit on 51,200
//   elements of normal values and as many of denormal inputs, where a plain FMA chain into the
//   destination differed in 64% of them.
//   The unit built from it (kernels_amx_emu.cpp) runs the same packing and loops on any CPU with
//   AVX-512, so they are tested where no AMX exists; on an AMX CPU the two are held bit for bit
//   (tests/test_amx.py).
//
// Included only by kernels_amx.cpp, inside its anonymous namespace, after <immintrin.h>, <cstdint>
// and <cstring>.
#pragma once

// What the kernels hand to tile_configure: rows and bytes a row for each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#ifndef HETMOE_AMX_EMULATED

// Not _tile_loadconfig: GCC 12's declares its memory operand as one pointer ("m"(*(const void**)p)),
// so the optimizer may drop the stores of rows and colsb before LDTILECFG as dead. It did in
// amx_gemm_i8, leaving tiles of 0 rows, and TILEZERO faulted (#UD, SIGILL) on a Xeon with AMX. Here
// the operand is the whole 64-byte configuration.
inline void tile_configure(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }
inline void tile_release() { _tile_release(); }
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)

#else

struct EmulatedTiles {
  TileConfig cfg;
  alignas(64) uint8_t tile[8][16][64];
};
thread_local EmulatedTiles tl_tiles;

inline void tile_configure(const TileConfig& cfg) {
  tl_tiles.cfg = cfg;
  std::memset(tl_tiles.tile, 0, sizeof(tl_tiles.tile));  // LDTILECFG zeroes every tile
}

inline void tile_release() { tl_tiles.cfg = TileConfig{}; }  // TILERELEASE: back to the init state

inline void tile_zero(int t) { std::memset(tl_tiles.tile[t], 0, sizeof(tl_tiles.tile[t])); }

// Rows beyond the configured count and bytes beyond a row's configured width read as zero.
inline void tile_load(int t, const void* p, int64_t stride) {
  const int rows = tl_tiles.cfg.rows[t], colsb = tl_tiles.cfg.colsb[t];
  tile_zero(t);
  for (int r = 0; r < rows; ++r) std::memcpy(tl_tiles.tile[t][r], static_cast<const uint8_t*>(p) + r * stride, colsb);
}

inline void tile_store(int t, void* p, int64_t stride) {
  const int rows = tl_tiles.cfg.rows[t], colsb = tl_tiles.cfg.colsb[t];
  for (int r = 0; r < rows; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, tl_tiles.tile[t][r], colsb);
}

inline float emu_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// bf16 to fp32 with denormals taken as zero (DAZ).
inline float emu_bf16_daz(uint16_t v) { return emu_bits((v & 0x7F80u) ? uint32_t(v) << 16 : uint32_t(v & 0x8000u) << 16); }
// An fp32 result with denormals flushed to zero (FTZ), sign kept.
inline float emu_ftz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x7F800000u) ? f : emu_bits(u & 0x80000000u);
}

// C[m][n] += sum_k A[m][2k] * B[k][2n] + A[m][2k+1] * B[k][2n+1] as the SDM defines TDPBF16PS.
inline void tile_dpbf16ps(int c, int a, int b) {
  const TileConfig& cfg = tl_tiles.cfg;
  const int M = cfg.rows[c], N = cfg.colsb[c] / 4, Kp = cfg.colsb[a] / 4;
  for (int m = 0; m < M; ++m) {
    float* dst = reinterpret_cast<float*>(tl_tiles.tile[c][m]);
    const uint16_t* arow = reinterpret_cast<const uint16_t*>(tl_tiles.tile[a][m]);
    for (int n = 0; n < N; ++n) {
      float even = 0.f, odd = 0.f;
      for (int k = 0; k < Kp; ++k) {
        const uint16_t* brow = reinterpret_cast<const uint16_t*>(tl_tiles.tile[b][k]);
        even = emu_ftz(__builtin_fmaf(emu_bf16_daz(arow[2 * k]), emu_bf16_daz(brow[2 * n]), even));
        odd = emu_ftz(__builtin_fmaf(emu_bf16_daz(arow[2 * k + 1]), emu_bf16_daz(brow[2 * n + 1]), odd));
      }
      dst[n] = emu_ftz(emu_ftz(dst[n]) + emu_ftz(even + odd));  // the destination is read with DAZ too
    }
  }
}

// C[m][n] += sum_k sum_i A[m][4k + i] * B[k][4n + i], int8 x int8 into int32 (TDPBSSD; the sum wraps
// modulo 2^32 as the hardware's does, computed unsigned so that C++ has no overflow to trip on).
inline void tile_dpbssd(int c, int a, int b) {
  const TileConfig& cfg = tl_tiles.cfg;
  const int M = cfg.rows[c], N = cfg.colsb[c] / 4, Kq = cfg.colsb[a] / 4;
  for (int m = 0; m < M; ++m) {
    uint32_t* dst = reinterpret_cast<uint32_t*>(tl_tiles.tile[c][m]);
    const int8_t* arow = reinterpret_cast<const int8_t*>(tl_tiles.tile[a][m]);
    for (int n = 0; n < N; ++n) {
      uint32_t acc = dst[n];
      for (int k = 0; k < Kq; ++k) {
        const int8_t* brow = reinterpret_cast<const int8_t*>(tl_tiles.tile[b][k]);
        for (int i = 0; i < 4; ++i) acc += uint32_t(int32_t(arow[4 * k + i]) * int32_t(brow[4 * n + i]));
      }
      dst[n] = acc;
    }
  }
}

#define TILE_ZERO(t) tile_zero(t)
#define TILE_LOAD(t, p, stride) tile_load(t, p, stride)
#define TILE_STORE(t, p, stride) tile_store(t, p, stride)
#define TILE_DPBF16PS(c, a, b) tile_dpbf16ps(c, a, b)
#define TILE_DPBSSD(c, a, b) tile_dpbssd(c, a, b)

#endif
