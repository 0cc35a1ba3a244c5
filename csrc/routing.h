// A router's choice from its logits, in the engine: what the one-call decode layer (decode_step.h)
// routes with, and what models/adapters/routing.py's softmax_topk and topk_softmax call for CPU
// logits, so that the one-call layer and the module-by-module forward route alike.
#pragma once
#include <cstdint>

namespace hetmoe {

// Softmax over each row's `experts` logits (fp32 or bf16, `dtype` 0 or 1), then its `k` largest
// probabilities, largest first, equal ones ordered as torch.topk orders them on a CPU. The
// probabilities are exp(x - max) / sum in double, rounded once to fp32; with `normalize`, each chosen
// weight is its exp over the sum of the chosen exps instead (the same value as softmax-then-
// renormalise, and as a softmax of the k largest logits, rounded once). `round_bf16`: the weights
// rounded to bf16 as torch rounds a float into a bf16 tensor (Qwen's, OLMoE's and gpt-oss's routers
// give them in the logits' dtype), then stored as fp32. ids [rows, k] int64, weights [rows, k] fp32.
void softmax_topk(const void* logits, int dtype, int64_t rows, int64_t experts, int k, bool normalize,
                  bool round_bf16, int64_t* ids, float* weights);

}  // namespace hetmoe
