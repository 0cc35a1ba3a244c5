// One traits row per storage method (ggml-cpu's type_traits_cpu, for this engine): what every layer
// needs to know of a method that does not depend on the instruction set. The per-ISA code (GEMV,
// dequantizer, GEMM paths) lives in each unit's KernelTable, indexed by the same Method.
//
// Adding a method is one row here (the static_asserts below refuse a table that misses one or
// lists them out of order), its kernels in kernels_common.inc and its codec in Python; Python reads
// the rows through _C.methods() rather than repeating them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels.h"

namespace hetmoe {

// GGUF's blocks as stored (ggml-common.h's layouts), checked against the sizes ggml gives them.
struct BlockQ4_0 {
  uint16_t d;       // fp16 scale
  uint8_t qs[16];   // low nibbles: weights 0-15, high: 16-31
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[32];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];   // bit j: the fifth bit of weight j
  uint8_t qs[16];  // low nibbles as Q4_0's; w = d * (q - 16)
};
struct BlockIQ4NL {
  uint16_t d;
  uint8_t qs[16];   // indices into the IQ4_NL table, Q4_0's nibble order
};
struct BlockQ4K {
  uint16_t d, dmin;        // fp16 super-scales
  uint8_t scales[12];      // 8 six-bit scales and mins
  uint8_t qs[128];
};
struct BlockQ5K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];          // the fifth bits
  uint8_t qs[128];
};
struct BlockQ6K {
  uint8_t ql[128];         // low 4 bits
  uint8_t qh[64];          // high 2 bits
  int8_t scales[16];       // one per 16 weights
  uint16_t d;
};
struct BlockIQ4XS {
  uint16_t d;
  uint16_t scales_h;       // high 2 bits of the 8 six-bit scales
  uint8_t scales_l[4];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ8_0) == 34 && sizeof(BlockIQ4NL) == 18 && sizeof(BlockQ5_0) == 22,
              "ggml block sizes");
static_assert(sizeof(BlockQ4K) == 144 && sizeof(BlockQ5K) == 176 && sizeof(BlockQ6K) == 210, "ggml block sizes");
static_assert(sizeof(BlockIQ4XS) == 136, "ggml block sizes");

// How the AMX GEMM (tile_path.h) takes a method's rows beyond bf16's and int8's own paths: dequantized
// panels; its codes as exact bf16 values straight into the tiles (kernels_amx.cpp, gemm_nibble_t: 4-bit
// codes, Q8_0's int8 ones), the K-quants' with a min term that needs the activations' sums over each
// block of 32; or, where K is a multiple of 64, its weights scaled into two int8 digits a weight on
// TDPBSSD (amx_gemm_digits; the bf16 code tiles otherwise; kTileCodesMinDigits: the bf16 code tiles with
// the min term where they run, as HETMOE_AMX_4BIT=codes asks: Q4_K, whose mins go into its digits;
// kTileDigitsOnly: the digits, or dequantized panels where they do not run: Q6_K, a scale a 16).
enum TileCodes : int {
  kTileCodesNone = 0,
  kTileCodes = 1,
  kTileCodesMin = 2,
  kTileCodesDigits = 3,
  kTileCodesMinDigits = 4,
  kTileDigitsOnly = 5,
};
// Whether a method's codes go into the bf16 code tiles where its digits do not run.
constexpr bool has_code_tiles(int tile_codes) { return tile_codes != kTileCodesNone && tile_codes != kTileDigitsOnly; }

struct MethodTraits {
  Method method;
  const char* name;        // the engine's name of the stored layout (what _C.methods() reports)
  int block_weights;       // weights a stored block holds (1: an element format with scales apart)
  int block_bytes;         // bytes of such a block
  double bits_per_weight;  // stored bits a weight, scales included at their usual group (item sizing)
  int gemv_act;            // the activation layout its GEMVs read (ActQuant; act_layout widens it)
  bool scales_inside;      // scales live inside the blocks: no scale tensor
  int k_multiple;          // rows hold whole blocks of this many weights
  int tile_codes;          // TileCodes: whether the AMX GEMM decodes its codes into the tiles
};

constexpr MethodTraits kMethodTraits[] = {
    {kBF16, "bf16", 1, 2, 16, kActNone, false, 32, kTileCodesNone},
    {kInt8, "int8", 1, 1, 8, kActNatural, false, 32, kTileCodesNone},
    {kInt4, "int4", 2, 1, 4.5, kActPairs, false, 32, kTileCodesDigits},
    {kMXFP4, "mxfp4", 2, 1, 4.25, kActPairs, false, 32, kTileCodesDigits},
    {kFP8, "fp8", 1, 1, 8, kActNone, false, 32, kTileCodesNone},
    {kQ4K, "gguf:q4_k", 256, int(sizeof(BlockQ4K)), 4.5, kActQuadsK, true, 256, kTileCodesMinDigits},
    {kQ6K, "gguf:q6_k", 256, int(sizeof(BlockQ6K)), 6.5625, kActQuadsQ6K, true, 256, kTileDigitsOnly},
    {kQ5K, "gguf:q5_k", 256, int(sizeof(BlockQ5K)), 5.5, kActQuadsK, true, 256, kTileCodesMin},
    {kIQ4XS, "gguf:iq4_xs", 256, int(sizeof(BlockIQ4XS)), 4.25, kActQuadsHalves, true, 256, kTileCodesNone},
    {kQ4_0, "gguf:q4_0", 32, int(sizeof(BlockQ4_0)), 4.5, kActQuadsHalvesQ4, true, 32, kTileCodesDigits},
    {kQ8_0, "gguf:q8_0", 32, int(sizeof(BlockQ8_0)), 8.5, kActNatural, true, 32, kTileCodesDigits},
    {kIQ4NL, "gguf:iq4_nl", 32, int(sizeof(BlockIQ4NL)), 4.5, kActQuadsHalves, true, 32, kTileCodesNone},
    {kQ5_0, "gguf:q5_0", 32, int(sizeof(BlockQ5_0)), 5.5, kActQuadsHalves, true, 32, kTileCodesNone},
};

constexpr bool traits_rows_in_order() {
  for (int i = 0; i < int(sizeof(kMethodTraits) / sizeof(kMethodTraits[0])); ++i)
    if (kMethodTraits[i].method != i) return false;
  return true;
}
static_assert(sizeof(kMethodTraits) / sizeof(kMethodTraits[0]) == kNumMethods,
              "method_traits.h: every Method needs exactly one traits row");
static_assert(traits_rows_in_order(), "method_traits.h: the rows must be in Method order");
constexpr bool traits_block_bits_agree() {  // a GGUF row's bits per weight are its block's
  for (const MethodTraits& t : kMethodTraits)
    if (t.scales_inside && t.block_bytes * 8.0 / t.block_weights != t.bits_per_weight) return false;
  return true;
}
static_assert(traits_block_bits_agree(), "method_traits.h: a block format's bits per weight must be its block's");

constexpr const MethodTraits& method_traits(int method) { return kMethodTraits[method]; }

}  // namespace hetmoe
