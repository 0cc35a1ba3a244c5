// Scalar decoders of the common GGUF block types, one block at a time, each evaluating the float32
// expression of hetmoe/formats/gguf/legacy.py and kquants.py (ggml's dequantize_row_*) in the same
// order. Every intermediate product there (codes of at most 7 bits, 6- or 8-bit sub-scales, fp16
// scales of 11 significant bits) is exact in fp32, so each weight rounds once, at its last operation,
// as formats/gguf's does; -ffp-contract=off (setup.py) keeps any multiply-add from being fused across
// that rounding. An embedding lookup decodes one row per token: this takes ~1-2 us where the torch
// decoders take 25-120 us on a single row (the cost of their dozens of small tensor operations).
#include "gguf_rows.h"

#include <cstring>
#include <stdexcept>

#include "kquant_scales.h"

namespace hetmoe {
namespace {

// IEEE half to float, exactly (subnormals included); the scales were checked finite at load.
float f16_value(const uint8_t* p) {
  const uint32_t h = uint32_t(p[0]) | uint32_t(p[1]) << 8;
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: man * 2^-24, exact in fp32
      float f = float(man) * (1.0f / 16777216.0f);
      std::memcpy(&bits, &f, sizeof bits);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- blocks of 32 (legacy.py): element j in byte j's low nibble, j + 16 in its high one ----
int nibble32(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4; }
int fifth_bit(const uint8_t* qh, int j) { return (qh[j / 8] >> (j % 8)) & 1; }

void q4_0(const uint8_t* b, float* y) {  // (q - 8) * d
  const float d = f16_value(b);
  for (int j = 0; j < 32; ++j) y[j] = (float(nibble32(b + 2, j)) - 8.0f) * d;
}
void q4_1(const uint8_t* b, float* y) {  // q * d + m
  const float d = f16_value(b), m = f16_value(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = float(nibble32(b + 4, j)) * d + m;
}
void q5_0(const uint8_t* b, float* y) {  // (q - 16) * d
  const float d = f16_value(b);
  for (int j = 0; j < 32; ++j) y[j] = (float(nibble32(b + 6, j) | fifth_bit(b + 2, j) << 4) - 16.0f) * d;
}
void q5_1(const uint8_t* b, float* y) {  // q * d + m
  const float d = f16_value(b), m = f16_value(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = float(nibble32(b + 8, j) | fifth_bit(b + 4, j) << 4) * d + m;
}
void q8_0(const uint8_t* b, float* y) {  // q * d
  const float d = f16_value(b);
  for (int j = 0; j < 32; ++j) y[j] = float(int8_t(b[2 + j])) * d;
}

// ---- superblocks of 256 (kquants.py) ----
// Sub-block s (32 weights) of Q4_K/Q5_K: the low nibbles of 32-byte chunk s / 2 for even s, the high
// ones for odd s; Q5_K's fifth bit of weight l is bit s of qh[l]. q * (d * sc) - dmin * m.
template <bool Fifth>
void q45_k(const uint8_t* b, float* y) {
  const float d = f16_value(b), dmin = f16_value(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (Fifth ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    q4k_scale_min(b + 4, s, &sc, &mn);  // kquants.scale_min_k4
    const float dl = d * float(sc), ml = dmin * float(mn);
    for (int l = 0; l < 32; ++l) {
      int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0F;
      if (Fifth) q |= ((qh[l] >> s) & 1) << 4;
      y[32 * s + l] = float(q) * dl - ml;
    }
  }
}
// Q6_K: weight e = 128 h + r takes nibble r / 64 of ql[64 h + r % 64] and bits 2 (r / 32) of
// qh[32 h + r % 32] above it; (q - 32) * (d * scale[e / 16]).
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_value(b + 208);
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, r = e % 128;
    const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
    const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
    y[e] = (float(low | high << 4) - 32.0f) * (d * float(scales[e / 16]));
  }
}

struct Kind {
  const char* name;
  int block_bytes;
  int block_weights;
  void (*decode)(const uint8_t*, float*);
};
constexpr Kind kKinds[] = {
    {"q4_0", 18, 32, q4_0}, {"q4_1", 20, 32, q4_1},         {"q5_0", 22, 32, q5_0},          {"q5_1", 24, 32, q5_1},
    {"q8_0", 34, 32, q8_0}, {"q4_k", 144, 256, q45_k<false>}, {"q5_k", 176, 256, q45_k<true>}, {"q6_k", 210, 256, q6_k},
};

}  // namespace

std::vector<std::string> gguf_row_kinds() {
  std::vector<std::string> names;
  for (const Kind& k : kKinds) names.emplace_back(k.name);
  return names;
}

int64_t gguf_rows(const std::string& kind, const uint8_t* table, int64_t row_bytes, int64_t rows, const int64_t* ids,
                  int64_t n, int64_t k, float* out) {
  const Kind* found = nullptr;
  for (const Kind& c : kKinds)
    if (kind == c.name) found = &c;
  if (!found) throw std::invalid_argument("gguf_rows: no row decoder for ggml type '" + kind + "'");
  if (k % found->block_weights || row_bytes != k / found->block_weights * found->block_bytes)
    throw std::invalid_argument("gguf_rows: " + kind + " rows of " + std::to_string(k) + " weights are not " +
                                std::to_string(row_bytes) + " bytes");
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return i;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = table + ids[i] * row_bytes;
    float* y = out + i * k;
    for (int64_t blk = 0; blk < k / found->block_weights; ++blk)
      found->decode(row + blk * found->block_bytes, y + blk * found->block_weights);
  }
  return -1;
}

}  // namespace hetmoe
