#include "mla_step.h"

#include <cstring>
#include <vector>

#include "engine_common.h"
#include "norms.h"

namespace hetmoe {

namespace {

// The rope parts of `rows` rows (`width` bf16 values each, `stride` elements apart from x on) -> out
// [rows, width] bf16, as the architecture rotates them (MLARope).
void rotate(int mode, const uint16_t* x, int64_t stride, int64_t rows, const void* cos, const void* sin,
            uint16_t* out, int64_t width) {
  const int64_t half = width / 2;
  if (mode == kMLARopeComplex) {
    // torch: view_as_complex(x.float()) * freqs_cis, then type_as(x): (a + bi)(c + di) in fp32, each
    // part rounded once (this file is baseline x86-64 code: no FMA to fuse the products into)
    const float* cs = static_cast<const float*>(cos);
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* v = x + r * stride;
      uint16_t* o = out + r * width;
      for (int64_t i = 0; i < half; ++i) {
        const float a = engine::bf16_to_f32(v[2 * i]), b = engine::bf16_to_f32(v[2 * i + 1]);
        const float c = cs[2 * i], d = cs[2 * i + 1];
        const float ac = a * c, bd = b * d, ad = a * d, bc = b * c;
        o[2 * i] = engine::f32_to_bf16(ac - bd);
        o[2 * i + 1] = engine::f32_to_bf16(ad + bc);
      }
    }
    return;
  }
  // The rows gathered (de-interleaved where the pairs are: x0 x2 x4 ... x1 x3 x5 ...), then one call of
  // rotate_half's form, each operation rounded to bf16 (norms.h: rope). For the interleaved pairs this
  // is x1 * cos - x2 * sin and x2 * cos + x1 * sin, as transformers' interleaved rotary computes them.
  thread_local std::vector<uint16_t> gathered;
  gathered.resize(size_t(rows) * width);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* v = x + r * stride;
    uint16_t* g = gathered.data() + r * width;
    if (mode == kMLARopeInterleaved)
      for (int64_t i = 0; i < half; ++i) g[i] = v[2 * i], g[half + i] = v[2 * i + 1];
    else
      std::memcpy(g, v, size_t(width) * 2);
  }
  rope(gathered.data(), cos, sin, out, kBF16Data, 1, rows, 1, width, false);
}

}  // namespace

double DecodeMLABlock::run(const void* x, const void* cos, const void* sin, uint8_t* cache, int64_t row_stride,
                           int64_t position, void* x_out, void* h_out) const {
  constexpr size_t kElem = 2;  // bf16
  const int64_t qk = nope + rope, q_cols = heads * qk, dk = rank + rope;
  thread_local std::vector<uint8_t> h, q_row, kv_row, q_normed, q_full, attn, o;
  thread_local std::vector<uint16_t> q_rot;
  thread_local std::vector<float> q_nope, query, q_lat, o_lat, out;
  h.resize(size_t(hidden) * kElem);
  rms_norm(x, input_norm.weight, h.data(), kBF16Data, 1, hidden, input_norm.eps, input_norm.mode);

  // q's input rows (q_a's or q_proj's) and the compressed kv: one fused linear, or two side by side
  const int64_t q_in_rows = q_rank ? q_rank : q_cols;
  const uint8_t* q_src;
  const uint8_t* ckv;
  if (kv_a) {
    q_row.resize(size_t(q_in_rows) * kElem);
    kv_row.resize(size_t(dk) * kElem);
    const int64_t a = q_in->submit(h.data(), kBF16Data, 1, q_row.data(), kBF16Data);
    const int64_t b = kv_a->submit(h.data(), kBF16Data, 1, kv_row.data(), kBF16Data);
    q_in->wait(a);
    kv_a->wait(b);
    q_src = q_row.data();
    ckv = kv_row.data();
  } else {
    q_row.resize(size_t(q_in_rows + dk) * kElem);
    linear_row(q_in, h.data(), kBF16Data, q_row.data(), kBF16Data);
    q_src = q_row.data();
    ckv = q_row.data() + size_t(q_in_rows) * kElem;
  }
  if (q_rank) {
    q_normed.resize(size_t(q_rank) * kElem);
    rms_norm(q_src, q_a_norm.weight, q_normed.data(), kBF16Data, 1, q_rank, q_a_norm.eps, q_a_norm.mode);
    q_full.resize(size_t(q_cols) * kElem);
    linear_row(q_b, q_normed.data(), kBF16Data, q_full.data(), kBF16Data);
    q_src = q_full.data();
  }
  const uint16_t* q = reinterpret_cast<const uint16_t*>(q_src);

  // The cache row: the normed latent, then the rotated key
  uint16_t* row = reinterpret_cast<uint16_t*>(cache + size_t(position) * row_stride * kElem);
  rms_norm(ckv, kv_a_norm.weight, row, kBF16Data, 1, rank, kv_a_norm.eps, kv_a_norm.mode);
  rotate(rope_mode, reinterpret_cast<const uint16_t*>(ckv) + rank, 0, 1, cos, sin, row + rank, rope);

  // The query over the cached rows: [q_lat (rank) | q_rope (rope)] per head, fp32
  q_nope.resize(size_t(heads) * nope);
  query.resize(size_t(heads) * dk);
  q_lat.resize(size_t(heads) * rank);
  q_rot.resize(size_t(heads) * rope);
  rotate(rope_mode, q + nope, qk, heads, cos, sin, q_rot.data(), rope);
  for (int64_t hd = 0; hd < heads; ++hd) {
    kt->bf16_to_f32(q + hd * qk, q_nope.data() + hd * nope, int(nope));
    kt->bf16_to_f32(q_rot.data() + hd * rope, query.data() + hd * dk + rank, int(rope));
  }
  head_gemv(kt, w_uk_t, heads, q_nope.data(), nope, q_lat.data());
  for (int64_t hd = 0; hd < heads; ++hd)
    std::memcpy(query.data() + hd * dk, q_lat.data() + hd * rank, size_t(rank) * sizeof(float));

  // One shared KV head: the heads split into groups, each a work item over the same rows (a zero batch
  // stride), as mla_attention._engine_decode does; values are the rows too, their rope part dropped after
  int64_t groups = 1;
  for (int64_t g : {8, 4, 2})
    if (heads % g == 0) {
      groups = g;
      break;
    }
  o_lat.resize(size_t(heads) * dk);
  attn_decode_heads(kt, query.data(), groups, 1, int(heads / groups), position + 1, int(dk), cache, 0, 0, row_stride,
                    cache, 0, 0, row_stride, kBF16Data, nullptr, nullptr, scale, o_lat.data());
  out.resize(size_t(heads) * v_dim);
  head_gemv(kt, w_uv, heads, o_lat.data(), dk, out.data());
  attn.resize(size_t(heads) * v_dim * kElem);
  kt->f32_to_bf16(out.data(), reinterpret_cast<uint16_t*>(attn.data()), int(heads * v_dim));
  o.resize(size_t(hidden) * kElem);
  linear_row(o_proj, attn.data(), kBF16Data, o.data(), kBF16Data);
  residual_post_norm(kt, x, o.data(), kBF16Data, hidden, post_norm, x_out, h_out);
  return ffn.run(kt, h_out, kBF16Data, hidden, x_out);
}

}  // namespace hetmoe
