// One token of one sequence through a latent-attention (MLA: DeepSeek-V2/V3/R1, Kimi-K2) decoder
// layer's attention half, in C++: the same kernels in the same order as the absorbed forward of
// hetmoe/models/mla_attention.py for one token, so the same values, in one call instead of ~25
// Python-level ones. RMSNorm -> q (q_a -> q_a_norm -> q_b, or q_proj) and the compressed kv (kv_a)
// -> kv_a_norm on the latent, rotary on the query's and key's rope parts -> the latent row appended
// to the cache -> q_lat = W_UK^T q_nope per head -> one shared KV head over the cached rows ->
// W_UV per head -> o_proj -> residual add -> post-attention RMSNorm. bf16 activations only (a CPU
// load runs MLA models in bf16); the per-head products run on bf16 blocks or on the file's own.
#pragma once
#include <cstdint>

#include "decode_step.h"

namespace hetmoe {

// How the architecture rotates the rope parts (models/adapters/deepseek_v{2,3}.py: mla_rotary):
enum MLARope : int {
  kMLARopeInterleaved = 0,  // DeepSeek-V3 with rope_interleave: pairs (x0, x1), (x2, x3), ... each rotated by
                            // one frequency, written de-interleaved (the first of each pair, then the
                            // second); cos/sin in bf16 [rope], each frequency twice (rotate_half's tables)
  kMLARopeHalf = 1,         // DeepSeek-V3 without it: rotate_half over the rope part, the same tables
  kMLARopeComplex = 2,      // DeepSeek-V2: pairs times complex fp32 factors (cos: [rope / 2] (re, im)
                            // pairs), in fp32 and rounded once, written interleaved as they came
};

struct DecodeMLABlock {
  const KernelTable* kt;
  int64_t hidden, heads, nope, rope, rank, v_dim;
  int64_t q_rank;  // q_lora_rank, or 0 where the query comes straight from q_proj (DeepSeek-V2-Lite)
  NormSpec input_norm, q_a_norm, kv_a_norm, post_norm;  // q_a_norm unused without q_rank
  int rope_mode;                                        // MLARope
  float scale;
  LinearEngine* q_in;  // hidden -> q_rank (q_a) or heads * (nope + rope) (q_proj); followed by the
                       // rank + rope rows of kv_a where kv_a is nullptr (the two fused)
  LinearEngine* kv_a;  // hidden -> rank + rope, or nullptr
  LinearEngine* q_b;   // q_rank -> heads * (nope + rope), or nullptr without q_rank
  // W_UK^T [heads, rank, nope] and W_UV [heads, v_dim, rank], read in place (owned by Python), each
  // head an "expert" of the projection (decode_step.h: head_gemv): bf16 blocks (the model's kv_b_proj),
  // or a GGUF file's attn_k_b and attn_v_b in their stored block type
  Proj w_uk_t, w_uv;
  LinearEngine* o_proj;  // heads * v_dim -> hidden
  DecodeFFN ffn;  // the rest of the layer (a dense MLP or the MoE block), or none

  // x [hidden] bf16 -> x_out = x + o_proj(attention), h_out = post_norm(x_out). The cache is
  // [capacity, rank + rope] bf16 rows `row_stride` elements apart; this token's row goes to
  // `position` and the query attends over rows 0 .. position. With ffn's half, x_out then also has
  // that half's output added: returns the seconds it took (else 0).
  double run(const void* x, const void* cos, const void* sin, uint8_t* cache, int64_t row_stride, int64_t position,
             void* x_out, void* h_out) const;
};

}  // namespace hetmoe
