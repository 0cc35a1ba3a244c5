// Fused RMSNorm and rotary embedding for the CPU inference path: one call instead of the ~7 eager ops transformers'
// norm modules issue (a decode step of a 4-layer model runs 17 of them). Baseline x86-64 code:
// it is short rows of arithmetic, not worth an ISA variant.
#pragma once
#include <cstdint>

namespace hetmoe {

// How the weight is applied, after h = x * rsqrt(mean(x^2) + eps) in fp32 (each transformers
// family rounds at its own point, and the fused op must round at the same one):
enum NormMode : int {
  kNormCastThenScale = 0,  // Llama/Qwen/DeepSeek/Mixtral: out = w * round(h), in the input dtype
  kNormScaleThenCast = 1,  // gpt-oss: out = round(w * h)
  kNormOffsetScale = 2,    // Qwen3-Next (zero-centred weight): out = round((1 + w) * h)
};

// x, w, y in one dtype (0 fp32, 1 bf16, as DType); rows of `cols` contiguous elements.
void rms_norm(const void* x, const void* w, void* y, int dtype, int64_t rows, int64_t cols, float eps, int mode);

// Rotary embedding as transformers' apply_rotary_pos_emb computes it: out = x * cos + rotate_half(x)
// * sin, with rotate_half(x) = cat(-x[D/2:], x[:D/2]); in bf16 each of the three operations rounds
// (as torch's eager ops do), in fp32 none is fused. x, out: [B, H, T, D]; cos, sin: [B or 1, T, D].
void rope(const void* x, const void* cos, const void* sin, void* out, int dtype, int64_t batch, int64_t heads,
          int64_t tokens, int64_t dim, bool cos_batched);

}  // namespace hetmoe
