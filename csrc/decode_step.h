// One token of one sequence through a decoder layer's attention half, in C++: what a CPU-only decode
// step otherwise does as a dozen Python-level calls between the engine's kernels (measured ~100 us of
// a layer's ~1 ms on a 2-core Zen 5). The same kernels in the same order as those calls, so the same
// values: RMSNorm -> fused q/k/v linear -> q/k norms, rotary embedding, KV append, attention -> o_proj
// -> residual add -> post-attention RMSNorm -> (optionally) the router's logits.
#pragma once
#include <cstdint>

#include "kernels.h"
#include "linear_engine.h"
#include "routing.h"

namespace hetmoe {

class MoEEngine;

// One query token's attention for each (batch row, KV head), an item each over the engine's pool (the
// waiting caller included): q fp32 [B, KV, G, D] contiguous; K/V rows of (b, h) at k + (b * kb + h *
// kh) elements, kr / vr elements apart; mask fp32 additive [B, L] or nullptr; sinks fp32 [KV * G] (a
// logit per query head, kernels.h) or nullptr; out as q.
void attn_decode_heads(const KernelTable* kt, const float* q, int64_t batch, int64_t kv_heads, int groups, int64_t L,
                       int D, const uint8_t* k, int64_t kb, int64_t kh, int64_t kr, const uint8_t* v, int64_t vb,
                       int64_t vh, int64_t vr, int kv_dtype, const float* mask, const float* sinks, float scale,
                       float* out);

// y[h * N + n] = dot(W_h[n, :K], x + h * x_stride) for h < heads, n < N = p.n, K = p.k: a separate
// weight block per head (MLA's W_UK^T and W_UV), head h being the projection's "expert" h (rows
// p.w_rstride bytes apart, blocks p.w_estride), x fp32. bf16 blocks (models/mla_attention.py, K a
// multiple of 16) meet x as it is, in items of up to 64 rows; any other method's (a GGUF file's
// attn_k_b / attn_v_b as stored, models/mla_decode.py) meets each head's x quantized to the
// method's activation layout, an item a head, as LinearEngine's GEMVs do.
void head_gemv(const KernelTable* kt, const Proj& p, int64_t heads, const float* x, int64_t x_stride, float* y);
// The bf16 form: blocks w_head bytes apart, rows w_row bytes apart.
Proj bf16_head_blocks(const uint8_t* w, int64_t w_head, int64_t w_row, int N, int K);

// Where the step writes this token's key and value rows and reads the cache: [heads, capacity, D]
// buffers in the step's dtype, strides in elements (unit stride along D), `position` the new row; the
// query attends over rows [first, position] (first > 0: a sliding window's, runtime/kv_cache.py).
struct KVRows {
  uint8_t* k;
  uint8_t* v;
  int64_t k_head_stride, k_row_stride, v_head_stride, v_row_stride;
  int64_t position;
  int64_t first;
};

// The norms' parameters as fused_norms.py describes them (norms.h: NormMode).
struct NormSpec {
  const void* weight;
  float eps;
  int mode;
};

// Where a family RMS-normalises q and k (the norms' weights are q_norm/k_norm):
enum QKNorm : int {
  kQKNormNone = 0,        // Qwen2-MoE, Mixtral, GLM-4-MoE without use_qk_norm
  kQKNormPerHead = 1,     // Qwen3-MoE, GLM-4-MoE with use_qk_norm: each head's D values
  kQKNormProjection = 2,  // OLMoE, MiniMax-M2: the whole projection (H * D, KV * D) before the heads split
};

// qkv [(H + 2 KV) * D] in `dtype` (0 fp32, 1 bf16): q and k RMS-normed as `qk_norm` says, their first
// `rotary_dim` values of each head rotated (cos, sin [rotary_dim]; the rest pass through, as
// transformers' partial rotary does), k and v appended at kv.position, then the query over rows
// [kv.first, position], with the heads' sinks (fp32 [H]) where given; out [H * D] in `dtype`.
void decode_attention_step(const KernelTable* kt, const void* qkv, int dtype, int64_t heads, int64_t kv_heads,
                           int64_t D, int qk_norm, const NormSpec& q_norm, const NormSpec& k_norm,
                           int64_t rotary_dim, const void* cos, const void* sin, const KVRows& kv,
                           const float* sinks, float scale, void* out);

// y = e(x) for one row, waited on (x and y in kF32 or kBF16Data).
void linear_row(LinearEngine* e, const void* x, int x_dtype, void* y, int y_dtype);

// x_out = x + o as torch adds two tensors of the dtype (in fp32, rounded once), h_out = post_norm(x_out);
// all [hidden] in `dtype`. The tail of every one-call decode step (this file's and mla_step.h's).
void residual_post_norm(const KernelTable* kt, const void* x, const void* o, int dtype, int64_t hidden,
                        const NormSpec& post_norm, void* x_out, void* h_out);

// silu(x) over n values of `dtype`, rounded to the dtype: the engine's vectorised silu (kernels.h:
// silu_mul), what hetmoe's SiLU stands in for transformers' in the MLPs on the engine
// (hetmoe/runtime/engine_activations.py), so that the one-call layer below and a module's forward agree.
void silu_rounded(const KernelTable* kt, const void* x, int dtype, int64_t n, void* out);
// sigmoid(x) = 1 / (1 + exp(-x)) in fp32 over n values of `dtype`, rounded to the dtype: what a gated
// shared expert's gate takes in both paths (models/adapters/qwen2_moe.py: gated_shared_expert).
void sigmoid_rounded(const void* x, int dtype, int64_t n, void* out);

// A dense SwiGLU MLP for one row as transformers' MLP modules compute it in the dtype, each of its
// linears in the engine: down(silu(gate(h)) * up(h)), silu as silu_rounded, the product as torch
// multiplies two tensors of the dtype.
struct DecodeMLP {
  LinearEngine* gate_up = nullptr;  // [hidden] -> [2 inter]: gate's rows then up's (fused siblings), or
  LinearEngine* gate = nullptr;     // gate and up apart, or nullptr with gate_up
  LinearEngine* up = nullptr;
  LinearEngine* down = nullptr;  // [inter] -> [hidden]; nullptr: no MLP
  int64_t inter() const { return down ? down->cols() : 0; }
  // out [hidden] = the MLP of h [hidden], both in dtype (the linears on the pool)
  void run(const KernelTable* kt, const void* h, int dtype, void* out) const;
};

// How the MoE half routes from the router's logits (routing.h):
enum MoERouting : int {
  kRouteSoftmaxTopk = 0,  // softmax_topk of the block's logits in its dtype (Qwen3-MoE, Mixtral, OLMoE, gpt-oss)
  kRouteGrouped = 1,      // grouped_topk of fp32 logits (DeepSeek-V2/V3, Kimi-K2, GLM-4.x), or of the block's
                          // logits taken to fp32 (MiniMax-M2)
};

// The rest of a decoder layer after its attention half, run by a one-call block where every routed
// expert is in one CPU engine (none on a device: hetmoe/models/fast_decode.py and mla_decode.py check
// each step): route, the engine's forward of h_out, the shared experts (if any) meanwhile, the
// experts' output plus the shared one's, then x_out += that, each sum as torch adds two tensors of
// the dtype. What HybridMoE's forward_routed does for one token with the same engine, without
// returning to Python.
struct DecodeMoEHalf {
  MoEEngine* experts = nullptr;        // nullptr: the block ends at the router's logits
  const uint8_t* skip_mask = nullptr;  // the experts' skip mask [E] (CPUExperts owns it), read each step
  int top_k = 0;
  int routing = kRouteSoftmaxTopk;             // MoERouting
  bool normalize = false, round_bf16 = false;  // softmax_topk's
  GroupedTopk grouped;                         // grouped_topk's (its bias owned by Python)
  int64_t* counts = nullptr;  // tokens each expert took [E] (HybridMoE's counts), incremented; or nullptr
  DecodeMLP shared;           // the shared experts, or none (down nullptr)
  // Qwen2-MoE's and Qwen3-Next's gate on the shared experts: a bf16 engine linear [hidden] fp32 ->
  // [1] fp32 (routing.py's router_logits on an fp32 copy of h, rounded to the dtype), whose
  // sigmoid_rounded multiplies their output as torch multiplies two tensors of the dtype; or nullptr
  LinearEngine* shared_gate = nullptr;
};

// x_out [hidden] += mlp(h [hidden]) as torch adds them, both in dtype; returns the seconds it took.
double run_mlp_half(const KernelTable* kt, const DecodeMLP& mlp, const void* h, int dtype, int64_t hidden,
                    void* x_out);

// moe for h [hidden] (dtype) routed from `logits` ([E] of logits_dtype), added to x_out [hidden];
// returns the seconds it took.
double run_moe_half(const KernelTable* kt, const DecodeMoEHalf& moe, const void* logits, int logits_dtype,
                    const void* h, int dtype, int64_t hidden, void* x_out);

// A layer's second half run from h inside a one-call block, where hetmoe/models/ffn_half.py gives it
// one: a dense layer's MLP, or a MoE block routed by a grouped router (kRouteGrouped) from fp32 logits
// of an fp32 copy of h, as models/adapters/routing.py's router_logits computes them (a bf16 router in
// the engine, or an fp32 weight through routing.h's router_logits_f32), its shared experts included.
struct DecodeFFN {
  LinearEngine* router = nullptr;     // [hidden] fp32 -> [experts] fp32, or
  const float* router_f32 = nullptr;  // [experts, hidden] fp32 (owned by Python)
  DecodeMoEHalf moe;                  // experts nullptr: no MoE block
  DecodeMLP mlp;                      // down nullptr: no MLP
  // x_out [hidden] += the half's output for h [hidden], both in dtype; the seconds it took, 0 where
  // there is no half (the caller runs the layer's MLP).
  double run(const KernelTable* kt, const void* h, int dtype, int64_t hidden, void* x_out) const;
};

// A decoder layer's attention half for one token (shapes checked by the Python side once, when it
// makes the block, and the per-step pointers by hetmoe/models/fast_decode.py); with `moe`, the whole
// layer.
struct DecodeAttentionBlock {
  const KernelTable* kt;
  int dtype;  // of the hidden states and every weight the step touches
  int64_t hidden, heads, kv_heads, D;
  NormSpec input_norm, q_norm, k_norm, post_norm;
  int qk_norm;         // QKNorm; q_norm and k_norm are unused under kQKNormNone
  int64_t rotary_dim;  // even, <= D: the leading values of each head that rotate
  const float* sinks;  // fp32 [heads] (gpt-oss), owned by Python, or nullptr
  float scale;
  LinearEngine* qkv;     // [hidden] -> [(H + 2 KV) * D], or q alone [H * D] where k_proj and v_proj are set
  LinearEngine* k_proj;  // [hidden] -> [KV * D] where q/k/v are separate linears (their methods differ:
  LinearEngine* v_proj;  // a Q4_K_M file's attn_v in Q6_K beside Q4_K), else nullptr
  LinearEngine* o_proj;  // [H * D] -> [hidden]
  LinearEngine* router;  // [hidden] fp32 -> [experts] fp32, or nullptr
  // Qwen3-Next's gated attention: q_proj gives each head's D query values then D gate values
  // ([H * 2D] where the query alone is [H * D]), and the attention's output is multiplied by
  // sigmoid(gate) before o_proj, as transformers' Qwen3NextAttention does in the dtype.
  bool gated = false;
  DecodeMoEHalf moe;  // with the router: the rest of the layer, routed by softmax top-k from its logits
  DecodeFFN ffn;      // without a router: the rest of the layer, or none

  // The q projection's output width: [H * D], or [H * 2D] when gated.
  int64_t q_width() const { return heads * D * (gated ? 2 : 1); }

  // x [hidden] -> x_out = x + o_proj(attention(...)), h_out = post_norm(x_out), both [hidden] in
  // dtype; with a router, logits [experts] = router(fp32(h_out)) rounded to dtype, as
  // models/adapters/routing.py computes a bf16 router's logits. With moe.experts (and the router) or
  // with ffn's half (and no router), x_out then also has that half's output added; returns the seconds
  // that part took (else 0).
  double run(const void* x, const void* cos, const void* sin, const KVRows& kv, void* x_out, void* h_out,
             void* logits) const;
};

}  // namespace hetmoe
