// The per-ISA kernel table. Each ISA translation unit (kernels_avx2.cpp, kernels_avx512.cpp,
// kernels_amx.cpp) is compiled with its own -m flags and fills one table; nothing it defines is
// visible to the others (everything lives in an anonymous namespace), so the linker can never
// hand an AVX-512 instantiation of a shared inline function to AVX2 code.
//
// This header is included by every ISA unit: it holds declarations and plain data only.
#pragma once
#include <atomic>
#include <cstdint>

namespace hetmoe {

// Storage methods the engine runs. The numbers cross the Python boundary (runtime/engine_layout.py).
enum Method : int {
  kBF16 = 0,   // bf16 [N, K]
  kInt8 = 1,   // int8 [N, K], fp32 scale per row
  kInt4 = 2,   // 4-bit codes [N, K/2] (low nibble = even k), w = (code - zero) * scale per group;
               // zero = 8 or a uint8 [N, K/g] array; scale bf16 or fp16 (int4, int4-asym, gptq repacked)
  kMXFP4 = 3,  // E2M1 codes as kInt4's layout, w = e2m1(code) * 2^(e8m0 - 127) per 32
  kFP8 = 4,    // float8_e4m3fn [N, K], fp32 scale per (row block, column block) or per row
  kQ4K = 5,    // GGUF Q4_K superblocks as stored (144 bytes per 256)
  kQ6K = 6,    // GGUF Q6_K superblocks as stored (210 bytes per 256)
  kQ5K = 7,    // GGUF Q5_K superblocks as stored (176 bytes per 256)
  kIQ4XS = 8,  // GGUF IQ4_XS superblocks as stored (136 bytes per 256)
  kQ4_0 = 9,   // GGUF Q4_0 blocks as stored (18 bytes per 32)
  kQ8_0 = 10,  // GGUF Q8_0 blocks as stored (34 bytes per 32)
  kIQ4NL = 11, // GGUF IQ4_NL blocks as stored (18 bytes per 32)
  kQ5_0 = 12,  // GGUF Q5_0 blocks as stored (22 bytes per 32)
  kNumMethods = 13,
};

enum ScaleKind : int { kScaleF32 = 0, kScaleBF16 = 1, kScaleF16 = 2, kScaleE8M0 = 3 };
constexpr int scale_kind_bytes(int kind) { return kind == kScaleF32 ? 4 : kind == kScaleE8M0 ? 1 : 2; }

constexpr int kActBlock = 32;   // activation quantization block (int16 codes + fp32 scale)
constexpr int kGemvTokens = 4;  // the GEMV kernels take at most this many tokens per call
constexpr int kPanelRows = 24;  // rows of a dequantized fp32 panel used by the GEMM kernels

// One projection of every expert of a layer, e.g. gate: [E, N, K] in some method's layout.
// Scales of row n live at s + e * s_estride + (n / s_row_div) * s_rstride, one per `group`
// elements of K (int8: group = K; fp8 block: group = 128, s_row_div = 128).
struct Proj {
  const uint8_t* w = nullptr;  // codes or values
  const uint8_t* s = nullptr;  // scales (unused for bf16)
  const uint8_t* z = nullptr;  // kInt4 zero points, uint8 [N, K/group]; nullptr means 8
  int64_t w_estride = 0, w_rstride = 0;  // bytes between experts / rows of w
  int64_t s_estride = 0, s_rstride = 0;  // bytes between experts / scale rows
  int64_t z_estride = 0, z_rstride = 0;
  int n = 0, k = 0;   // rows (outputs), columns (inputs)
  int group = 0;      // K elements sharing one scale
  int s_row_div = 1;  // rows sharing one scale row
  int method = kBF16;
  int scale_kind = kScaleF32;
};

// One activation row as the kernels want it: fp32 values, and for integer kernels int16 codes
// in blocks of 32 with a scale per block (amax / 32639: the rounding error is ~1e-5 relative, so
// integer dot products cost no accuracy worth measuring, unlike int8 activations at ~5e-3: the
// explicit choice g_act_one_digit below).
// kActNatural: each block's codes evens first then odds (k = 0,2,..,30,1,3,..,31), the order a
// 16-bit lane of weight bytes splits into. kActPairs (4-bit formats): the same codes stored
// exactly as two int8 digits (256 * hi + lo) for u8 x s8 dot products, in the
// paired-block layout described in kernels_common.inc. `sum` is each block's sum of codes.
struct Act {
  const float* f = nullptr;
  const int16_t* q = nullptr;
  const float* d = nullptr;
  const int32_t* sum = nullptr;  // per block: sum of its codes (for formats with a min term, Q4_K)
  // The GEMV runs 512 bits wide: the activations are in a 512-bit layout (kActQuads, kActNaturalPairs,
  // the GGUF digit layouts), or, for the bf16 GEMV on `h`, its tuned width (kWidthFloat) is 512.
  bool wide = false;
  // The same row in bf16, where the caller's activations were bf16 (so `f` holds the same values) and
  // the CPU has AVX512-BF16 (engine_common.h: bf16_x): the bf16 GEMV multiplies on it (VDPBF16PS).
  const uint16_t* h = nullptr;
  // Codes quantized at int8 level (engine_common.h: act_one_digit): a digit layout's lo digits all 0,
  // which the 512-bit digit GEMVs then skip; every other GEMV reads the codes as they are.
  bool one_digit = false;
};
// The explicit, lower-accuracy choice for the 4- to 6-bit GEMVs' activations (HETMOE_ACTIVATION_BITS=8):
// each block's codes rounded to int8 (256 * round(127 x / amax): llama.cpp's Q8 activations, ~5e-3
// relative on a projection's output where the default's int16-level codes give ~2e-5, measured in
// tests/test_activation_bits.py), so that the 512-bit digit GEMVs run
// half their VPDPBUSDs. Read when a job allocates its activation buffers (engine_common.h:
// act_one_digit), so a change applies to the next job. Off by default.
extern std::atomic<bool> g_act_one_digit;

// The 512-bit GEMVs' layouts, for the whole groups of 8 blocks of a row (kernels_common.inc; the blocks
// after the last whole group stay in the 256-bit layout, act_tail_layout): kActQuads,
// kActPairs' digits with four blocks per group instead of two; kActNaturalPairs, kActNatural's codes
// with the evens of two blocks side by side, then their odds; kActQuadsHalves, kActQuadsK and
// kActQuadsQ6K, the digits of four blocks ordered as GGUF's blocks hold their nibbles (Q4_0, Q5_0, IQ4_NL, IQ4_XS: a
// block's k 0-15 then 16-31; Q4_K, Q5_K: blocks b and b + 2, then b + 1 and b + 3; Q6_K: b and
// b + 1, then b + 2 and b + 3; each block in k order). kActQuadsQ6K's sums are per 16 codes (Q6_K's
// scales are), the others' per block.
enum ActQuant : int {
  kActNone = 0,
  kActNatural = 1,
  kActPairs = 2,
  kActQuads = 3,
  kActNaturalPairs = 4,
  kActQuadsHalves = 5,
  kActQuadsK = 6,
  kActQuadsQ6K = 7,
  kActQuadsHalvesQ4 = 8,
  kActPairsHalves = 9,
};
// kActQuadsHalvesQ4 (Q4_0) is kActQuadsHalves byte for byte at 512 bits; its 256-bit form (the
// 256-bit GEMVs and a wide row's tail) is kActPairsHalves, kActPairs' digits with each block's k 0-15
// where kActPairs has its even k and 16-31 where it has the odd: Q4_0's nibbles (codes 0-15) then
// meet them as int4's do, two blocks a 256-bit vector (gemv_nibble_t). The other GGUF digit layouts
// run on int16 codes (kActNatural) at 256 bits: IQ4's codes (its table + 128, up to 241) are past what
// PMADDUBSW's int16 lanes hold for a digit pair, and Q5_0 on digits, its fifth bits merged a pair at a
// time, ran slower than on int16 codes (Zen 4's AVX2 unit, 4096 x 2048 in cache: 300-314 -> 328-361 us).
inline bool act_is_gguf_digits(int mode) { return mode >= kActQuadsHalves && mode <= kActQuadsHalvesQ4; }  // 512-bit only
inline bool act_is_wide(int mode) { return mode == kActQuads || mode == kActNaturalPairs || act_is_gguf_digits(mode); }
inline bool act_is_digits(int mode) {
  return mode == kActPairs || mode == kActQuads || mode == kActPairsHalves || act_is_gguf_digits(mode);
}
inline int act_sums(int mode, int K) { return mode == kActQuadsQ6K ? K / 16 : K / kActBlock; }  // per row
// A 512-bit layout's 256-bit form: the layout the 256-bit GEMVs read, and that of a row's blocks past
// its last whole group of 8 in the 512-bit layout (the K-quants, per 256 weights, never have such blocks).
inline int act_tail_layout(int mode) {
  if (mode == kActQuads) return kActPairs;
  if (mode == kActQuadsHalvesQ4) return kActPairsHalves;
  return mode == kActNaturalPairs || act_is_gguf_digits(mode) ? kActNatural : mode;
}

// Rows [r0, r0 + R) (R <= kAmxRows) of expert e of a projection: a block of one amx_gemm_digits call.
struct RowBlock {
  const Proj* p = nullptr;
  int e = 0, r0 = 0, R = 0;
};

struct KernelTable {
  const char* name;
  // y[t * ldy + (n - n0)] = dot(W_e[n, :], x_t) for n in [n0, n1), t < T <= kGemvTokens.
  void (*gemv[kNumMethods])(const Proj& p, int e, int n0, int n1, const Act* x, int T, float* y, int ldy);
  // Rows [n0, n1) of expert e as fp32 into panel[(n - n0) * K + k]; n1 - n0 <= kPanelRows.
  void (*dequant_rows[kNumMethods])(const Proj& p, int e, int n0, int n1, float* panel);
  // c[t * ldc + r] = dot(panel[r, :K], a[t][:K]) for r < R (<= kPanelRows), t < T.
  void (*gemm_panel)(const float* panel, int R, int K, const float* const* a, int T, float* c, int ldc);
  // c[t * ldc + r] = dot(w[r * w_stride :][:K], a[t][:K]) over bf16 weight rows and bf16 activation
  // rows (K a multiple of 32), products summed in fp32 (VDPBF16PS). nullptr in units without it; run
  // only where the CPU has AVX512-BF16 (engine_common.h: bf16_dot).
  void (*gemm_bf16)(const uint16_t* w, int64_t w_stride, int R, int K, const uint16_t* const* a, int T, float* c,
                    int ldc);
  // Quantize one fp32 row of K (a multiple of 32) to int16 blocks as described at Act; the codes
  // rounded to multiples of 256 (int8 level: g_act_one_digit) where `one_digit`.
  void (*quantize_row)(const float* x, int K, int mode, int16_t* q, float* d, int32_t* sum, bool one_digit);
  // The layout a method's GEMV reads for rows of K with its GEMVs `bits` wide (engine_common.h:
  // gemv_bits): kActPairs and kActNatural become their 512-bit layouts at 512 bits (K a multiple of
  // 256); the GGUF digit layouts (512-bit only) become kActNatural where the GEMVs do not run 512 wide.
  int (*act_layout)(int mode, int K, int bits);
  // h[i] = silu(g[i]) * u[i]
  void (*silu_mul)(const float* g, const float* u, float* h, int n);
  // Clamped SwiGLU of gpt-oss: g = min(g, limit); u = clamp(u, -limit, limit);
  // h = (u + 1) * g * sigmoid(alpha * g)
  void (*swiglu_oai)(const float* g, const float* u, float* h, int n, float alpha, float limit);
  // y[i] = sum over j < m of w[j] * rows[j][i], for i < n: a token's expert outputs weighted and
  // summed, one fused multiply-add a term, in order of j (zeros where m = 0)
  void (*weighted_sum)(const float* const* rows, const float* w, int m, int n, float* y);
  // dst[i] = float(src_bf16[i])
  void (*bf16_to_f32)(const uint16_t* src, float* dst, int n);
  // dst[i] = bf16(src[i]), round to nearest even, NaN kept a (quiet) NaN
  void (*f32_to_bf16)(const float* src, uint16_t* dst, int n);
  // Independent FMA chains for `iters` rounds (the doctor's peak measurement); returns the flops
  // done. `sink` receives a result so the work cannot be optimized away.
  double (*fma_burn)(int64_t iters, float* sink);
  // One query token over one KV head (decode): out[g, :D] = softmax(scale * q[g] . K^T + mask) V for
  // the G query heads [G, D] fp32 sharing it; K, V rows of D (a multiple of 16) in fp32 (kv_dtype
  // 0) or bf16 (1), k_row / v_row elements apart; mask: additive [L] or nullptr; sinks: [G] fp32
  // logits that join each head's softmax and are dropped from it (gpt-oss), or nullptr; scores: [G, L].
  void (*attn_decode)(const float* q, int G, const void* k, const void* v, int kv_dtype, int64_t L, int D,
                      int64_t k_row, int64_t v_row, const float* mask, const float* sinks, float scale,
                      float* scores, float* out);
  // M query rows (prefill) over one KV head: out[m][:Dv] = softmax(scale * q[m] . K^T + mask[m]) V over
  // the keys l < visible[m]; q rows fp32 [Dk]; K rows of Dk, V rows of Dv (multiples of 16) in fp32
  // (kv_dtype 0) or bf16 (1), k_row / v_row elements apart; mask[m]: additive fp32 [L] or nullptr
  // (mask itself may be nullptr); sinks: [M] fp32 per row, as attn_decode's, or nullptr; scratch:
  // kAttnScratch(M, Dk, Dv) floats.
  void (*attn_prefill)(const float* const* q, int M, const int64_t* visible, const void* k, const void* v,
                       int kv_dtype, int Dk, int Dv, int64_t k_row, int64_t v_row, const float* const* mask,
                       const float* sinks, float scale, float* const* out, float* scratch);

  // ---- AMX tiles (kernels_amx.cpp; nullptr in the other units; tile_path.h drives them) ----
  // T activation rows of K (a multiple of 32) as B tiles: bf16 hi, and lo = bf16(x - hi) unless
  // lo is nullptr; amx_packed_elems(T, K) elements each.
  void (*amx_pack)(const float* const* a, int T, int K, uint16_t* hi, uint16_t* lo);
  // R rows of an fp32 panel [R, K] as row-major bf16 hi (and lo) rows.
  void (*amx_split)(const float* panel, int R, int K, uint16_t* hi, uint16_t* lo);
  // c[t * ldc + r] = dot(w[r], x[t]) for r < R (<= kAmxRows), t < T: w_hi x_hi + w_hi x_lo + w_lo x_hi,
  // each lo term where it is given. w rows are w_stride elements apart, 16 * ceil(R / 16) readable.
  void (*amx_gemm)(const uint16_t* w_hi, const uint16_t* w_lo, int64_t w_stride, int R, int K,
                   const uint16_t* x_hi, const uint16_t* x_lo, int T, float* c, int ldc);
  // T activation rows of K (a multiple of 64) as int8 digit B tiles (hi and lo, amx_packed_elems(T, K)
  // bytes each) and a scale per token (16 * ceil(T / 16) floats, 0 past T): kernels_amx.cpp.
  void (*amx_pack_i8)(const float* const* a, int T, int K, int8_t* hi, int8_t* lo, float* d);
  // amx_pack_i8 in two steps: one row of K into its digits in k order (hi, lo: K bytes each, 64-byte
  // aligned) and its scale; then T tokens' digit rows as the B tiles (and the scales gathered by the caller).
  void (*amx_digit_rows)(const float* a, int K, int8_t* hi, int8_t* lo, float* d);
  void (*amx_tile_digit_rows)(const int8_t* const* hi_rows, const int8_t* const* lo_rows, int T, int K, int8_t* hi,
                              int8_t* lo);
  // c[t * ldc + r] = w_scale[r] * dot(w[r], x[t]) for int8 rows (w_stride bytes apart, 16 * ceil(R / 16)
  // readable), r < R (<= kAmxRows), over amx_pack_i8's digits.
  void (*amx_gemm_i8)(const int8_t* w, int64_t w_stride, const float* w_scale, int R, int K, const int8_t* x_hi,
                      const int8_t* x_lo, const float* x_scale, int T, float* c, int ldc);
  // c[t * ldc + r] = dot(W_e[r0 + r], x[t]) for r < R (<= kAmxRows) of a projection whose traits row has
  // tile_codes (method_traits.h), its codes decoded into tiles chunk by chunk; x: amx_pack's tiles; x_sum
  // (the K-quants' min term, else unused): tile_path.h's TileActs::sums.
  void (*amx_gemm_nibble)(const Proj& p, int e, int r0, int R, const uint16_t* x_hi, const uint16_t* x_lo, int T,
                          const float* x_sum, float* c, int ldc);
  // The same for a projection whose traits row has kTileCodesDigits and K a multiple of 64 (tile_path.h's
  // tile_digits): its weights as two int8 digits on TDPBSSD against amx_pack_i8's digits. `next` (or
  // nullptr): the block this thread's next call will take, another tile_digits one, whose weights are
  // decoded into digits while this call's tiles run; a next call for another block decodes its own.
  void (*amx_gemm_digits)(const Proj& p, int e, int r0, int R, const int8_t* x_hi, const int8_t* x_lo,
                          const float* x_scale, int T, float* c, int ldc, const RowBlock* next);
};

constexpr int kAmxRows = 32;  // weight rows of one amx_gemm call: two A tiles
// Elements of one amx_pack output: token tiles of 16, each K/32 tiles of 512 bf16.
constexpr int64_t amx_packed_elems(int T, int K) { return int64_t((T + 15) / 16) * 16 * K; }
// Floats of scratch attn_prefill needs: a block of 64 K and V rows in fp32, M x 64 scores, and a
// running max and sum per row.
constexpr int64_t kAttnScratch(int M, int Dk, int Dv) { return 64 * int64_t(Dk + Dv) + int64_t(M) * 66; }

// Vector width of the AVX-512 unit's integer GEMVs: 512 or 256 (cpu_features.cpp picks the default; the
// tuner measures each), per family of activation layouts and per regime, since they differ in which
// width is faster (an AMD Zen 4, 2 threads: int8 at one token an expert 8-13% faster at 256 bits and at
// 8 tokens an expert 7% faster at 512; int4 faster at 512 in both). Families: [kWidthNatural] the
// int16-code GEMVs (kActNatural: int8, Q8_0), [kWidthDigits] the 4-bit ones (kActPairs and the GGUF
// digit layouts). Regimes: [kWidthDecode] a job whose every GEMV call is one pass of at most
// kGemvTokens tokens (decode), [kWidthPrompt] the rest. Read when a job picks its activation layout
// (engine_common.h: act_quant_for; the GEMVs follow the layout), so a change applies to the next job.
// Atomic: Python sets them while the pool's workers read them.
// [kWidthFloat]: the bf16 GEMV on bf16 activations (VDPBF16PS, where the CPU has AVX512-BF16), whose
// Act::wide the job sets from it; the GEMVs on fp32 activations (bf16's on fp32 rows, fp8's) run
// the variant's full width whatever it is. On 2 vCPUs of an Intel Xeon with AMX (family 6 model 167) a
// Qwen3-30B-A3B bf16 layer's 1-token decode from DRAM took 2.31-2.57 ms at 256 bits and 2.67-2.73
// at 512 (the fp32-activation down projection at 256 bits: no change), alternating.
enum IntWidthFamily : int { kWidthDigits = 0, kWidthNatural = 1, kWidthFloat = 2, kWidthFamilies = 3 };
enum IntWidthRegime : int { kWidthDecode = 0, kWidthPrompt = 1, kWidthRegimes = 2 };
inline int width_family(int mode) {
  return mode == kActNone ? kWidthFloat : mode == kActNatural ? kWidthNatural : kWidthDigits;
}
extern std::atomic<int> g_int_vector_bits[kWidthFamilies][kWidthRegimes];
// How the GEMVs prefetch the weight rows they stream (kernels_common.inc: prefetch_line): into every
// cache level (T0), non-temporally (NTA), into L2 and outward but not L1 (T1), or not at all (the
// hardware's prefetchers alone). Per family of GEMVs, which the tuner measures apart because they can
// disagree: on an AMD EPYC (Zen 4, 2 threads, a Qwen3-30B-A3B layer's 1-token decode from DRAM, 40
// alternating rounds, medians) the 4-bit GEMVs, whose arithmetic keeps the core busy, once ran 5-14%
// faster with a software prefetch than without while int8 and bf16 ran 2-11% slower (an earlier
// tuning there had int4 12% faster with NTA, bf16 16% slower); an hour later all within 3% of none.
// Families: [kPrefetchDigits]
// and [kPrefetchNatural] as the widths' (kWidthDigits: the 4- to 6-bit GEMVs, kWidthNatural: int8,
// Q8_0), [kPrefetchFloat] the GEMVs on fp32 or bf16 arithmetic (bf16, fp8). Atomic for the same
// reason; read relaxed (a hint: a worker that sees the old value a moment longer is fine).
enum WeightPrefetch : int { kPrefetchT0 = 0, kPrefetchNta = 1, kPrefetchT1 = 2, kPrefetchNone = 3 };
enum PrefetchFamily : int { kPrefetchDigits = 0, kPrefetchNatural = 1, kPrefetchFloat = 2, kPrefetchFamilies = 3 };
static_assert(int(kPrefetchDigits) == int(kWidthDigits) && int(kPrefetchNatural) == int(kWidthNatural) &&
                  int(kPrefetchFloat) == int(kWidthFloat) && int(kPrefetchFamilies) == int(kWidthFamilies),
              "the prefetch families are the width families");
// The family of a method's GEMV from the activation layout it reads (MethodTraits::gemv_act).
inline int prefetch_family(int act_mode) { return width_family(act_mode); }
extern std::atomic<int> g_weight_prefetch[kPrefetchFamilies];
// From this K on, a decode GEMV on fp32 activations (bf16, fp8) streams several rows a pass, sharing each
// load of x: x's fp32 row then fills half of this CPU's L1d or more (cpu_features.cpp).
extern const int g_fp32_x_shared_min_k;

const KernelTable* avx2_kernels();
const KernelTable* avx512_kernels();
const KernelTable* amx_kernels();
// The AMX unit with its tile operations emulated in scalar code (amx_tiles.h): runs on any CPU with
// the AVX-512 unit's features; for tests, never chosen by "auto".
const KernelTable* amx_emu_kernels();

}  // namespace hetmoe
