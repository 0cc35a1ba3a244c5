// The engines' GEMM path on AMX tiles (the table's amx_* kernels, kernels_amx.cpp), shared by
// MoEEngine and LinearEngine: an item's activation rows are packed into B tiles once, then its
// weight rows go kAmxRows at a time through the tile GEMMs. bf16 weights are A tiles as stored, and
// so are int8 codes (on int8 tiles); 4-bit weights, Q6_K's and Q8_0's become two int8 digits a weight
// with their scales inside (int4, gptq, Q4_0, Q4_K, mxfp4, Q6_K, Q8_0), or, where K is not a multiple
// of 64, enter bf16 tiles as their exact integer codes, the scales applied after each group's
// products (and so Q5_K's always); every other method is dequantized to an fp32 panel by its
// dequant_rows kernel and split into bf16 hi and lo rows (the split keeps ~1e-5 accuracy:
// kernels_amx.cpp).
//
// Compiled with the baseline flags only, like engine_common.h.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "engine_common.h"
#include "kernels.h"

namespace hetmoe {
namespace engine {

inline bool tile_gemm(const KernelTable* kt) { return kt->amx_gemm != nullptr; }

// How a projection meets the tiles: int8 rows with one fp32 scale a row (K a multiple of 64) on
// TDPBSSD against int8 digits of the activations (amx_gemm_i8), and so 4-bit rows (tile_digits below);
// every other method on bf16 tiles against the activations' bf16 hi/lo (the K-quants' codes decoded into
// tiles by amx_gemm_nibble, bf16 rows as stored, the rest through dequantized panels).
inline bool tile_int8(const KernelTable* kt, const Proj& p) {
  return kt->amx_gemm_i8 && p.method == kInt8 && p.scale_kind == kScaleF32 && p.s_row_div == 1 && p.k % 64 == 0;
}

// 4-bit, Q6_K and Q8_0 rows whose traits row takes the digits, K a multiple of 64 (a TDPBSSD step) and at most 2^16
// (the int32 accumulators sum two products of |127 * 128| a k): as two int8 digits a weight on TDPBSSD
// against the activations' digits (amx_gemm_digits); K short of a 64 multiple takes the bf16 code tiles.
// HETMOE_AMX_4BIT=codes keeps them all on the bf16 code tiles, Q6_K (which has none) on dequantized
// panels (read once: the A/B the benchmarks ran).
inline bool tile_digits(const KernelTable* kt, const Proj& p) {
  static const bool codes_only = [] {
    const char* env = std::getenv("HETMOE_AMX_4BIT");
    return env && std::strcmp(env, "codes") == 0;
  }();
  const int codes = method_traits(p.method).tile_codes;
  return kt->amx_gemm_digits && !codes_only &&
         (codes == kTileCodesDigits || codes == kTileCodesMinDigits || codes == kTileDigitsOnly) && p.k % 64 == 0 &&
         p.k <= 65536;
}
// Whether a projection's rows run on the bf16 code tiles with a min term (the activations' block sums).
inline bool tile_codes_with_min(const KernelTable* kt, const Proj& p) {
  const int codes = method_traits(p.method).tile_codes;
  return kt->amx_gemm_nibble &&
         (codes == kTileCodesMin || (codes == kTileCodesMinDigits && !tile_digits(kt, p)));
}
// Whether a projection's tile GEMM reads the activations' int8 digits (amx_pack_i8) or their bf16 tiles.
inline bool tile_reads_digits(const KernelTable* kt, const Proj& p) { return tile_int8(kt, p) || tile_digits(kt, p); }

// A scratch vector grown to at least n elements, as a pointer aligned to 64 bytes. Tiles are read a
// 64-byte row at a time: a tile row off a cache line spans two lines (vector's own storage is 16-byte
// aligned), and in-process on the AMX Xeon the int4 layer at 512 tokens took ~1.5 ms longer with its
// activations' digit tiles 16 bytes off (docs/benchmarks.md). GroupTiles' buffers come from uninit,
// whose blocks are 64-byte aligned, and its tiles are whole multiples of 64 bytes.
template <typename T>
T* sized_aligned(std::vector<T>& v, size_t n) {
  constexpr size_t pad = 64 / sizeof(T);
  return align64(sized(v, n + pad));
}

// Per-worker buffers: a dequantized panel and its bf16 rows, a tail of stored rows.
struct TileScratch {
  std::vector<uint16_t> w_hi, w_lo;
  std::vector<float> panel;
  std::vector<uint8_t> tail;  // stored rows copied beside zero rows (tile_rows_as_stored)
};
inline thread_local TileScratch tl_tile;

// Activations packed for the tile GEMMs (GroupTiles): bf16 hi and lo (lo nullptr: the rows are exactly
// bf16), int8 digits and their scales, block sums.
struct TileActs {
  const uint16_t* hi = nullptr;
  const uint16_t* lo = nullptr;
  const int8_t* q_hi = nullptr;
  const int8_t* q_lo = nullptr;
  const float* q_d = nullptr;
  // sums[b * Tp + t]: the fp32 sum of x_t[32 b .. 32 b + 31] (0 for the padding tokens t in [T, Tp),
  // Tp = 16 * ceil(T / 16)), where a projection's tile kernel has a min term
  const float* sums = nullptr;
  int T = 0;
};

// The forms a tile GEMM of projections a and b reads its activations in; with_lo: keep each value's
// remainder after bf16 rounding (leave it out only for rows that are exactly bf16).
struct TileForms {
  bool bf16 = false, lo = false, sums = false, digits = false;
};
inline TileForms tile_forms(const KernelTable* kt, bool with_lo, const Proj& a, const Proj& b) {
  TileForms f;
  f.bf16 = !tile_reads_digits(kt, a) || !tile_reads_digits(kt, b);
  f.lo = f.bf16 && with_lo;
  f.sums = tile_codes_with_min(kt, a) || tile_codes_with_min(kt, b);
  f.digits = tile_reads_digits(kt, a) || tile_reads_digits(kt, b);
  return f;
}

// Whether projections a and b both read the activations as digits only, so that an expert's tokens can
// be tiled from digit rows computed once for the batch (GroupTiles::pack_digit_rows).
inline bool tile_digit_rows(const KernelTable* kt, const Proj& a, const Proj& b) {
  return kt->amx_tile_digit_rows != nullptr && tile_reads_digits(kt, a) && tile_reads_digits(kt, b);
}

// Activations packed once for all of a job's items: row groups (a MoE job's tile-path experts, each
// its tokens; a linear job's token chunks) in the forms their tile GEMMs read, in buffers the job
// owns, one 16-token tile an item of a phase of their own; a group read by a single work item is
// packed by that item instead, into a GroupTiles of the thread's. Packed by every item, each item of a
// large expert packed all its tokens again: Mixtral-8x7B's bf16 layer at 512 tokens, in 1 MiB items
// (117 an expert's 14336-row projection), spent 39% of a prefill in amx_pack on the AMX Xeon (perf).
class GroupTiles {
 public:
  // Groups of counts[g] rows of K each (a plan replaces the one before).
  void plan(const std::vector<int>& counts, int K, const TileForms& forms) {
    K_ = K;
    counts_ = counts;
    first_tile_.assign(1, 0);
    for (int c : counts) first_tile_.push_back(first_tile_.back() + (c + 15) / 16);
    const size_t tiles = size_t(first_tile_.back()), elems = tiles * 16 * size_t(K);
    hi_.reset(), lo_.reset(), q_hi_.reset(), q_lo_.reset(), q_d_.reset(), sums_.reset();  // a plan's own forms
    if (tiles == 0) return;
    if (forms.bf16) hi_ = uninit<uint16_t>(elems);
    if (forms.lo) lo_ = uninit<uint16_t>(elems);
    if (forms.sums) sums_ = uninit<float>(tiles * 16 * size_t(K / 32));
    if (forms.digits) {
      q_hi_ = uninit<int8_t>(elems);
      q_lo_ = uninit<int8_t>(elems);
      q_d_ = uninit<float>(tiles * 16);
    }
  }
  int items() const { return first_tile_.empty() ? 0 : first_tile_.back(); }
  // The rows `item` packs: its group's rows [row, row + n), n <= 16.
  void locate(int item, int& group, int& row, int& n) const {
    group = int(std::upper_bound(first_tile_.begin(), first_tile_.end(), item) - first_tile_.begin()) - 1;
    row = 16 * (item - first_tile_[group]);
    n = std::min(16, counts_[group] - row);
  }
  // One group of `count` rows of K, planned and packed by the caller alone, a tile at a time:
  // pack_tile(*this, item, row, n) as a phase's item would pack rows [row, row + n).
  template <typename PackTile>
  TileActs pack_alone(int count, int K, const TileForms& forms, PackTile pack_tile) {
    plan({count}, K, forms);
    for (int j = 0; j < items(); ++j) {
      int group, row, n;
      locate(j, group, row, n);
      pack_tile(*this, j, row, n);
    }
    return acts(0);
  }
  // Item `item`'s n (<= 16) rows, fp32.
  void pack(const KernelTable* kt, int item, const float* const* rows, int n) {
    const int64_t at = int64_t(item) * 16 * K_;
    if (hi_) kt->amx_pack(rows, n, K_, hi_.get() + at, lo_ ? lo_.get() + at : nullptr);
    if (q_hi_) kt->amx_pack_i8(rows, n, K_, q_hi_.get() + at, q_lo_.get() + at, q_d_.get() + 16 * item);
    if (sums_) {  // a group's sums are [K / 32][its tiles' rows] (TileActs::sums)
      int group, row, tile_n;  // tile_n == n
      locate(item, group, row, tile_n);
      const int Tp = 16 * (first_tile_[group + 1] - first_tile_[group]);
      float* sums = sums_.get() + int64_t(first_tile_[group]) * 16 * (K_ / 32) + row;
      for (int b = 0; b < K_ / 32; ++b)
        for (int t = 0; t < 16; ++t) {
          float sum = 0.f;
          if (t < n)
            for (int i = 0; i < 32; ++i) sum += rows[t][32 * b + i];
          sums[int64_t(b) * Tp + t] = sum;
        }
    }
  }
  // Item `item`'s n (<= 16) rows from their digit rows (amx_digit_rows), where the forms are digits only.
  void pack_digit_rows(const KernelTable* kt, int item, const int8_t* const* hi, const int8_t* const* lo,
                       const float* d, int n) {
    const int64_t at = int64_t(item) * 16 * K_;
    kt->amx_tile_digit_rows(hi, lo, n, K_, q_hi_.get() + at, q_lo_.get() + at);
    for (int t = 0; t < 16; ++t) q_d_.get()[16 * item + t] = t < n ? d[t] : 0.f;
  }
  // Group g's packed rows.
  TileActs acts(int g) const {
    const int64_t tile0 = first_tile_[g], at = tile0 * 16 * K_;
    TileActs x;
    x.T = counts_[g];
    if (hi_) x.hi = hi_.get() + at;
    if (lo_) x.lo = lo_.get() + at;
    if (sums_) x.sums = sums_.get() + tile0 * 16 * (K_ / 32);
    if (q_hi_) {
      x.q_hi = q_hi_.get() + at;
      x.q_lo = q_lo_.get() + at;
      x.q_d = q_d_.get() + 16 * tile0;
    }
    return x;
  }

 private:
  int K_ = 0;
  std::vector<int> counts_, first_tile_;  // first_tile_[g]: group g's first tile; one past the last at the end
  Buf<uint16_t> hi_, lo_;
  Buf<int8_t> q_hi_, q_lo_;
  Buf<float> q_d_, sums_;
};

// Rows [r0, r0 + R) of expert e as stored, `bytes` a row: where a tile would read past them (R short of
// the 16-row tile), a copy beside zero rows in `tail`; `stride` becomes the copy's.
inline const uint8_t* tile_rows_as_stored(const Proj& p, int e, int r0, int R, int padded, int64_t bytes,
                                          std::vector<uint8_t>& tail, int64_t& stride) {
  const uint8_t* w = p.w + e * p.w_estride + int64_t(r0) * p.w_rstride;
  stride = p.w_rstride;
  if (R == padded) return w;
  uint8_t* copy = sized(tail, size_t(padded) * bytes);
  for (int r = 0; r < R; ++r) std::memcpy(copy + r * bytes, w + r * p.w_rstride, bytes);
  std::memset(copy + R * bytes, 0, size_t(padded - R) * bytes);
  stride = bytes;
  return copy;
}

// c[t * ldc + (n - n0)] = dot(W_e[n], x_t) for rows [n0, n1) of one projection, t < x.T. `then`: the
// block this thread takes after these rows (amx_gemm_digits' `next`), or nullptr.
inline void tile_rows(const KernelTable* kt, const Proj& p, int e, int n0, int n1, const TileActs& x, float* c,
                      int ldc, const RowBlock* then = nullptr) {
  std::vector<uint8_t>& tail = tl_tile.tail;
  const int K = p.k;
  for (int r0 = n0; r0 < n1; r0 += kAmxRows) {
    const int r1 = std::min(n1, r0 + kAmxRows), R = r1 - r0;
    const int padded = R > 16 ? kAmxRows : 16;  // the kernels read whole A tiles of 16 rows
    float* out = c + (r0 - n0);
    int64_t stride = 0;
    if (tile_digits(kt, p)) {
      // the block this thread takes next, decoded while this one's tiles run: the next rows, or `then`
      const RowBlock following{&p, e, r1, std::min(n1, r1 + kAmxRows) - r1};
      const RowBlock* next = r1 < n1 ? &following : then;
      if (next && !tile_digits(kt, *next->p)) next = nullptr;
      kt->amx_gemm_digits(p, e, r0, R, x.q_hi, x.q_lo, x.q_d, x.T, out, ldc, next);
      continue;
    }
    if (kt->amx_gemm_nibble && has_code_tiles(method_traits(p.method).tile_codes)) {
      kt->amx_gemm_nibble(p, e, r0, R, x.hi, x.lo, x.T, x.sums, out, ldc);
      continue;
    }
    if (tile_int8(kt, p)) {
      const uint8_t* w = tile_rows_as_stored(p, e, r0, R, padded, K, tail, stride);
      float scale[kAmxRows];
      for (int r = 0; r < R; ++r) {
        const uint8_t* s = p.s + e * p.s_estride + int64_t(r0 + r) * p.s_rstride;
        std::memcpy(&scale[r], s, sizeof(float));
      }
      kt->amx_gemm_i8(reinterpret_cast<const int8_t*>(w), stride, scale, R, K, x.q_hi, x.q_lo, x.q_d, x.T, out, ldc);
      continue;
    }
    if (p.method == kBF16) {
      const uint8_t* w = tile_rows_as_stored(p, e, r0, R, padded, int64_t(K) * 2, tail, stride);
      kt->amx_gemm(reinterpret_cast<const uint16_t*>(w), nullptr, stride / 2, R, K, x.hi, x.lo, x.T,
                   out, ldc);
      continue;
    }
    float* panel = sized(tl_tile.panel, size_t(padded) * K);
    for (int q0 = r0; q0 < r1; q0 += kPanelRows)  // dequant_rows takes at most kPanelRows rows
      kt->dequant_rows[p.method](p, e, q0, std::min(r1, q0 + kPanelRows), panel + size_t(q0 - r0) * K);
    std::memset(panel + size_t(R) * K, 0, size_t(padded - R) * K * sizeof(float));
    uint16_t* hi = sized_aligned(tl_tile.w_hi, size_t(padded) * K);
    uint16_t* lo = sized_aligned(tl_tile.w_lo, size_t(padded) * K);
    kt->amx_split(panel, padded, K, hi, lo);
    kt->amx_gemm(hi, lo, K, R, K, x.hi, x.lo, x.T, out, ldc);
  }
}

}  // namespace engine
}  // namespace hetmoe
