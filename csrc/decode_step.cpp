#include "decode_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "engine_common.h"
#include "moe_engine.h"
#include "norms.h"
#include "routing.h"
#include "thread_pool.h"

namespace hetmoe {

void attn_decode_heads(const KernelTable* kt, const float* q, int64_t batch, int64_t kv_heads, int groups, int64_t L,
                       int D, const uint8_t* k, int64_t kb, int64_t kh, int64_t kr, const uint8_t* v, int64_t vb,
                       int64_t vh, int64_t vr, int kv_dtype, const float* mask, const float* sinks, float scale,
                       float* out) {
  const size_t elem = kv_dtype == kBF16Data ? 2 : 4;
  auto job = std::make_shared<ForJob>(int(batch * kv_heads), [=](int item) {
    thread_local std::vector<float> scores;
    if (scores.size() < size_t(groups) * L) scores.resize(size_t(groups) * L);
    const int64_t b = item / kv_heads, h = item % kv_heads;
    const size_t qo = (size_t(b) * kv_heads + h) * groups * D;
    kt->attn_decode(q + qo, groups, k + (b * kb + h * kh) * elem, v + (b * vb + h * vh) * elem, kv_dtype, L, D, kr, vr,
                    mask ? mask + b * L : nullptr, sinks ? sinks + h * groups : nullptr, scale, scores.data(),
                    out + qo);
  });
  global_pool()->submit(job);
  job->wait();
}

Proj bf16_head_blocks(const uint8_t* w, int64_t w_head, int64_t w_row, int N, int K) {
  Proj p;
  p.w = w;
  p.w_estride = w_head;
  p.w_rstride = w_row;
  p.n = N;
  p.k = K;
  p.method = kBF16;
  return p;
}

void head_gemv(const KernelTable* kt, const Proj& p, int64_t heads, const float* x, int64_t x_stride, float* y) {
  const int N = p.n;
  if (p.method == kBF16) {
    constexpr int kRows = 64;
    const int chunks = (N + kRows - 1) / kRows;
    auto job = std::make_shared<ForJob>(int(heads * chunks), [=, &p](int item) {
      const int h = item / chunks, n0 = item % chunks * kRows, n1 = std::min(N, n0 + kRows);
      Act a;
      a.f = x + h * x_stride;
      kt->gemv[kBF16](p, h, n0, n1, &a, 1, y + int64_t(h) * N + n0, 0);
    });
    global_pool()->submit(job);
    job->wait();
    return;
  }
  // One token's layout for this method and width (what LinearEngine's one-token GEMV reads)
  const int mode = engine::act_quant_for(kt, p.method, p.k, 1);
  auto job = std::make_shared<ForJob>(int(heads), [=, &p](int h) {
    // One buffer per layout a thread meets: MLA alternates W_UK^T (K = nope) and W_UV (K = rank)
    thread_local engine::ActBuffers buffers[2];
    engine::ActBuffers* act = nullptr;
    for (engine::ActBuffers& b : buffers)
      if (b.K == p.k && b.mode == mode) act = &b;
    if (!act) {
      act = &buffers[buffers[0].K != 0];
      act->allocate(1, p.k, mode);
    }
    act->one_digit = engine::act_one_digit(p.method);  // a buffer kept from an earlier call
    const float* xh = x + h * x_stride;
    act->quantize(kt, xh, 0);
    const Act a = act->act(xh, 0);
    kt->gemv[p.method](p, h, 0, N, &a, 1, y + int64_t(h) * N, 0);
  });
  global_pool()->submit(job);
  job->wait();
}

namespace {

// Rotary embedding of `heads` rows of D values, the first `rot` of each rotated and the rest copied.
void rope_heads(const void* x, const void* cos, const void* sin, void* out, int dtype, int64_t heads, int64_t D,
                int64_t rot) {
  if (rot == D) {
    rope(x, cos, sin, out, dtype, 1, heads, 1, D, true);
    return;
  }
  const size_t elem = dtype == kBF16Data ? 2 : 4;
  for (int64_t h = 0; h < heads; ++h) {
    const uint8_t* src = static_cast<const uint8_t*>(x) + size_t(h) * D * elem;
    uint8_t* dst = static_cast<uint8_t*>(out) + size_t(h) * D * elem;
    rope(src, cos, sin, dst, dtype, 1, 1, 1, rot, true);
    std::memcpy(dst + rot * elem, src + rot * elem, (D - rot) * elem);
  }
}

}  // namespace

void decode_attention_step(const KernelTable* kt, const void* qkv, int dtype, int64_t heads, int64_t kv_heads,
                           int64_t D, int qk_norm, const NormSpec& q_norm, const NormSpec& k_norm,
                           int64_t rotary_dim, const void* cos, const void* sin, const KVRows& kv,
                           const float* sinks, float scale, void* out) {
  const size_t elem = dtype == kBF16Data ? 2 : 4;
  const uint8_t* src = static_cast<const uint8_t*>(qkv);
  thread_local std::vector<uint8_t> normed, rotated;
  thread_local std::vector<float> qf, of;
  rotated.resize(size_t(heads + kv_heads) * D * elem);
  const uint8_t* qn = src;
  const uint8_t* kn = src + size_t(heads) * D * elem;
  if (qk_norm != kQKNormNone) {
    normed.resize(rotated.size());
    uint8_t* q_out = normed.data();
    uint8_t* k_out = q_out + size_t(heads) * D * elem;
    // Per head: rows of D; over the projection: one row of all the heads' values.
    const bool per_head = qk_norm == kQKNormPerHead;
    rms_norm(qn, q_norm.weight, q_out, dtype, per_head ? heads : 1, per_head ? D : heads * D, q_norm.eps,
             q_norm.mode);
    rms_norm(kn, k_norm.weight, k_out, dtype, per_head ? kv_heads : 1, per_head ? D : kv_heads * D, k_norm.eps,
             k_norm.mode);
    qn = q_out;
    kn = k_out;
  }
  uint8_t* qr = rotated.data();
  uint8_t* kr = qr + size_t(heads) * D * elem;
  rope_heads(qn, cos, sin, qr, dtype, heads, D, rotary_dim);
  rope_heads(kn, cos, sin, kr, dtype, kv_heads, D, rotary_dim);
  const uint8_t* v_src = src + size_t(heads + kv_heads) * D * elem;
  for (int64_t h = 0; h < kv_heads; ++h) {
    std::memcpy(kv.k + (h * kv.k_head_stride + kv.position * kv.k_row_stride) * elem, kr + size_t(h) * D * elem,
                D * elem);
    std::memcpy(kv.v + (h * kv.v_head_stride + kv.position * kv.v_row_stride) * elem, v_src + size_t(h) * D * elem,
                D * elem);
  }
  qf.resize(size_t(heads) * D);
  of.resize(qf.size());
  if (dtype == kBF16Data)
    kt->bf16_to_f32(reinterpret_cast<const uint16_t*>(qr), qf.data(), int(heads * D));
  else
    std::memcpy(qf.data(), qr, qf.size() * sizeof(float));
  const size_t skip = size_t(kv.first) * elem;  // rows before the window
  attn_decode_heads(kt, qf.data(), 1, kv_heads, int(heads / kv_heads), kv.position + 1 - kv.first, int(D),
                    kv.k + skip * kv.k_row_stride, 0, kv.k_head_stride, kv.k_row_stride, kv.v + skip * kv.v_row_stride,
                    0, kv.v_head_stride, kv.v_row_stride, dtype, nullptr, sinks, scale, of.data());
  if (dtype == kBF16Data)
    kt->f32_to_bf16(of.data(), static_cast<uint16_t*>(out), int(heads * D));
  else
    std::memcpy(out, of.data(), of.size() * sizeof(float));
}

void linear_row(LinearEngine* e, const void* x, int x_dtype, void* y, int y_dtype) {
  e->wait(e->submit(x, x_dtype, 1, y, y_dtype));
}

namespace {

// out[i] = f(a[i], b[i]) over n values of `dtype`, as torch combines two tensors of the dtype: bf16
// operands widened to fp32 (exactly), the result rounded once. out may be a.
template <typename F>
void combine(const KernelTable* kt, const void* a, const void* b, int dtype, int64_t n, void* out, F f) {
  if (dtype == kBF16Data) {
    thread_local std::vector<float> af, bf;
    af.resize(n);
    bf.resize(n);
    kt->bf16_to_f32(static_cast<const uint16_t*>(a), af.data(), int(n));
    kt->bf16_to_f32(static_cast<const uint16_t*>(b), bf.data(), int(n));
    for (int64_t i = 0; i < n; ++i) af[i] = f(af[i], bf[i]);
    kt->f32_to_bf16(af.data(), static_cast<uint16_t*>(out), int(n));
    return;
  }
  const float* af = static_cast<const float*>(a);
  const float* bf = static_cast<const float*>(b);
  float* o = static_cast<float*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = f(af[i], bf[i]);
}

// v rounded to bf16 as torch rounds a float into a bf16 tensor (engine_common.h's f32_to_bf16).
float bf16_round(float v) {
  const uint32_t bits = uint32_t(engine::f32_to_bf16(v)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 1 / (1 + exp(-g)) in fp32, rounded to bf16 where `bf16`: a sigmoid as torch leaves it in a tensor
// of the dtype (apply_gate's and sigmoid_rounded's).
float sigmoid_in(float g, bool bf16) {
  const float s = 1.f / (1.f + std::exp(-g));
  return bf16 ? bf16_round(s) : s;
}

// Qwen3-Next's q_proj rows [H][query D | gate D] split into qkv's leading [H * D] (the queries, as an
// ungated q_proj gives them, k and v moved up after them) and gate [H * D]; `elem` bytes a value.
void split_gated_query(uint8_t* qkv, int64_t heads, int64_t kv_heads, int64_t D, size_t elem, uint8_t* gate) {
  const size_t head = size_t(D) * elem;
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(gate + h * head, qkv + (2 * h + 1) * head, head);
    std::memmove(qkv + h * head, qkv + 2 * h * head, head);  // forward: never over a query not yet moved
  }
  std::memmove(qkv + heads * head, qkv + 2 * heads * head, 2 * size_t(kv_heads) * head);
}

// out *= sigmoid(gate) over n values, as torch computes `out * torch.sigmoid(gate)` in the dtype:
// sigmoid in fp32 (1 / (1 + exp(-g))) rounded to the dtype, then the product in fp32 rounded once.
// (torch's vectorized exp and libm's expf are each within an ulp of exp, so the fp32 sigmoid may
// differ from torch's in its last bit: tests/test_fast_decode.py holds the path to that.)
void apply_gate(const KernelTable* kt, void* out, const void* gate, int dtype, int64_t n) {
  const bool bf16 = dtype == kBF16Data;
  combine(kt, out, gate, dtype, n, out, [bf16](float a, float g) { return a * sigmoid_in(g, bf16); });
}

}  // namespace

void residual_post_norm(const KernelTable* kt, const void* x, const void* o, int dtype, int64_t hidden,
                        const NormSpec& post_norm, void* x_out, void* h_out) {
  combine(kt, x, o, dtype, hidden, x_out, [](float a, float b) { return a + b; });  // as torch adds them
  rms_norm(x_out, post_norm.weight, h_out, dtype, 1, hidden, post_norm.eps, post_norm.mode);
}

double DecodeAttentionBlock::run(const void* x, const void* cos, const void* sin, const KVRows& kv, void* x_out,
                                 void* h_out, void* logits) const {
  const size_t elem = dtype == kBF16Data ? 2 : 4;
  thread_local std::vector<uint8_t> h, qkv_row, attn, o, gate;
  h.resize(size_t(hidden) * elem);
  qkv_row.resize(size_t(q_width() + 2 * kv_heads * D) * elem);
  attn.resize(size_t(heads) * D * elem);
  o.resize(size_t(hidden) * elem);
  rms_norm(x, input_norm.weight, h.data(), dtype, 1, hidden, input_norm.eps, input_norm.mode);
  if (k_proj) {  // three linears side by side on the pool, into the rows one fused linear would give
    uint8_t* out = qkv_row.data();
    const int64_t q = qkv->submit(h.data(), dtype, 1, out, dtype);
    const int64_t k = k_proj->submit(h.data(), dtype, 1, out + size_t(q_width()) * elem, dtype);
    const int64_t v = v_proj->submit(h.data(), dtype, 1, out + size_t(q_width() + kv_heads * D) * elem, dtype);
    qkv->wait(q);
    k_proj->wait(k);
    v_proj->wait(v);
  } else {
    linear_row(qkv, h.data(), dtype, qkv_row.data(), dtype);
  }
  if (gated) {
    gate.resize(size_t(heads) * D * elem);
    split_gated_query(qkv_row.data(), heads, kv_heads, D, elem, gate.data());
  }
  decode_attention_step(kt, qkv_row.data(), dtype, heads, kv_heads, D, qk_norm, q_norm, k_norm, rotary_dim, cos,
                        sin, kv, sinks, scale, attn.data());
  if (gated) apply_gate(kt, attn.data(), gate.data(), dtype, heads * D);
  linear_row(o_proj, attn.data(), dtype, o.data(), dtype);
  residual_post_norm(kt, x, o.data(), dtype, hidden, post_norm, x_out, h_out);
  if (!router) return ffn.run(kt, h_out, dtype, hidden, x_out);
  // The router takes an fp32 copy of h and rounds its fp32 logits to the dtype.
  thread_local std::vector<float> a;
  if (dtype == kBF16Data) {
    a.resize(hidden);
    kt->bf16_to_f32(static_cast<const uint16_t*>(h_out), a.data(), int(hidden));
    thread_local std::vector<float> lf;
    lf.resize(router->rows());
    linear_row(router, a.data(), kF32, lf.data(), kF32);
    kt->f32_to_bf16(lf.data(), static_cast<uint16_t*>(logits), router->rows());
  } else {
    linear_row(router, h_out, kF32, logits, kF32);
  }
  return moe.experts ? run_moe_half(kt, moe, logits, dtype, h_out, dtype, hidden, x_out) : 0;
}

void silu_rounded(const KernelTable* kt, const void* x, int dtype, int64_t n, void* out) {
  constexpr int64_t kChunk = 1024;
  float ones[kChunk], xf[kChunk], yf[kChunk];
  std::fill(ones, ones + kChunk, 1.f);
  for (int64_t i = 0; i < n; i += kChunk) {
    const int m = int(std::min(kChunk, n - i));
    if (dtype == kBF16Data) {
      kt->bf16_to_f32(static_cast<const uint16_t*>(x) + i, xf, m);
      kt->silu_mul(xf, ones, yf, m);  // silu(x) * 1: silu(x) exactly
      kt->f32_to_bf16(yf, static_cast<uint16_t*>(out) + i, m);
    } else {
      kt->silu_mul(static_cast<const float*>(x) + i, ones, static_cast<float*>(out) + i, m);
    }
  }
}

void sigmoid_rounded(const void* x, int dtype, int64_t n, void* out) {
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == kBF16Data)  // sigmoid_in's bf16 rounding is exact: its value fits the bf16 store
      static_cast<uint16_t*>(out)[i] = engine::f32_to_bf16(
          sigmoid_in(engine::bf16_to_f32(static_cast<const uint16_t*>(x)[i]), true));
    else
      static_cast<float*>(out)[i] = sigmoid_in(static_cast<const float*>(x)[i], false);
  }
}

void DecodeMLP::run(const KernelTable* kt, const void* h, int dtype, void* out) const {
  const size_t elem = dtype == kBF16Data ? 2 : 4;
  const int64_t n = inter();
  thread_local std::vector<uint8_t> gu, act;
  gu.resize(size_t(2 * n) * elem);
  act.resize(size_t(n) * elem);
  uint8_t* g = gu.data();
  uint8_t* u = g + size_t(n) * elem;
  if (gate_up) {
    linear_row(gate_up, h, dtype, g, dtype);
  } else {  // side by side on the pool
    const int64_t a = gate->submit(h, dtype, 1, g, dtype);
    const int64_t b = up->submit(h, dtype, 1, u, dtype);
    gate->wait(a);
    up->wait(b);
  }
  silu_rounded(kt, g, dtype, n, act.data());
  combine(kt, act.data(), u, dtype, n, act.data(), [](float a, float b) { return a * b; });
  linear_row(down, act.data(), dtype, out, dtype);
}

double run_mlp_half(const KernelTable* kt, const DecodeMLP& mlp, const void* h, int dtype, int64_t hidden,
                    void* x_out) {
  const auto start = std::chrono::steady_clock::now();
  thread_local std::vector<uint8_t> y;
  y.resize(size_t(hidden) * (dtype == kBF16Data ? 2 : 4));
  mlp.run(kt, h, dtype, y.data());
  combine(kt, x_out, y.data(), dtype, hidden, x_out, [](float a, float b) { return a + b; });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double DecodeFFN::run(const KernelTable* kt, const void* h, int dtype, int64_t hidden, void* x_out) const {
  if (mlp.down) return run_mlp_half(kt, mlp, h, dtype, hidden, x_out);
  if (!moe.experts) return 0;
  // The router takes an fp32 copy of h and keeps its fp32 logits (as DeepSeek's and GLM's compute)
  thread_local std::vector<float> hf, logits;
  const int64_t experts = moe.experts->experts();
  logits.resize(experts);
  const float* x = static_cast<const float*>(h);
  if (dtype == kBF16Data) {
    hf.resize(hidden);
    kt->bf16_to_f32(static_cast<const uint16_t*>(h), hf.data(), int(hidden));
    x = hf.data();
  }
  if (router_f32)
    router_logits_f32(kt, router_f32, experts, hidden, x, 1, logits.data());
  else
    linear_row(router, x, kF32, logits.data(), kF32);
  return run_moe_half(kt, moe, logits.data(), kF32, h, dtype, hidden, x_out);
}

double run_moe_half(const KernelTable* kt, const DecodeMoEHalf& moe, const void* logits, int logits_dtype,
                    const void* h, int dtype, int64_t hidden, void* x_out) {
  const auto start = std::chrono::steady_clock::now();
  const size_t elem = dtype == kBF16Data ? 2 : 4;
  const int64_t experts = moe.experts->experts();
  thread_local std::vector<int64_t> ids;
  thread_local std::vector<float> weights;
  thread_local std::vector<uint8_t> y, s;
  ids.resize(moe.top_k);
  weights.resize(moe.top_k);
  y.resize(size_t(hidden) * elem);
  if (moe.routing == kRouteGrouped) {
    const float* l = static_cast<const float*>(logits);
    thread_local std::vector<float> widened;
    if (logits_dtype == kBF16Data) {  // MiniMax-M2's bf16 logits, taken to fp32 (exactly) as its router does
      widened.resize(experts);
      kt->bf16_to_f32(static_cast<const uint16_t*>(logits), widened.data(), int(experts));
      l = widened.data();
    }
    grouped_topk(l, 1, experts, moe.top_k, moe.grouped, ids.data(), weights.data());
  } else {
    softmax_topk(logits, logits_dtype, 1, experts, moe.top_k, moe.normalize, moe.round_bf16, ids.data(),
                 weights.data());
  }
  const int64_t job =
      moe.experts->submit(h, dtype, 1, ids.data(), moe.top_k, weights.data(), y.data(), moe.skip_mask);
  if (moe.shared.down) {  // queued behind the experts' job on the pool, as HybridMoE computes them meanwhile
    s.resize(size_t(hidden) * elem);
    try {
      moe.shared.run(kt, h, dtype, s.data());
    } catch (...) {
      moe.experts->wait(job);  // the job writes into y: never leave it running
      throw;
    }
  }
  moe.experts->wait(job);
  if (moe.shared.down && moe.shared_gate) {  // s *= sigmoid(gate(h)), the gate's logit rounded to the dtype
    thread_local std::vector<float> hf;
    hf.resize(hidden);
    if (dtype == kBF16Data)
      kt->bf16_to_f32(static_cast<const uint16_t*>(h), hf.data(), int(hidden));
    else
      std::memcpy(hf.data(), h, size_t(hidden) * sizeof(float));
    float logit = 0;
    linear_row(moe.shared_gate, hf.data(), kF32, &logit, kF32);
    float sig;  // the sigmoid of the logit rounded to the dtype, as torch has it in a tensor of the dtype
    if (dtype == kBF16Data) {
      const uint16_t g = engine::f32_to_bf16(logit);
      uint16_t rounded;
      sigmoid_rounded(&g, dtype, 1, &rounded);
      sig = engine::bf16_to_f32(rounded);
    } else {
      sigmoid_rounded(&logit, dtype, 1, &sig);
    }
    combine(kt, s.data(), s.data(), dtype, hidden, s.data(), [sig](float a, float) { return a * sig; });
  }
  const auto add = [](float a, float b) { return a + b; };
  if (moe.shared.down) combine(kt, y.data(), s.data(), dtype, hidden, y.data(), add);  // routed + shared
  combine(kt, x_out, y.data(), dtype, hidden, x_out, add);  // the residual, as torch adds them
  if (moe.counts)
    for (int64_t id : ids)
      if (!moe.skip_mask || !moe.skip_mask[id]) ++moe.counts[id];
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace hetmoe
