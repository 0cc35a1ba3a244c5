// A router's choice from its logits, in the engine: what the one-call decode layer (decode_step.h)
// routes with, and what models/adapters/routing.py's softmax_topk and topk_softmax call for CPU
// logits, so that the one-call layer and the module-by-module forward route alike.
#pragma once
#include <cstdint>

#include "kernels.h"

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

// logits [T, rows] = x [T, cols] . w [rows, cols]^T, all fp32 (cols a multiple of 16): an fp32 router
// (DeepSeek's, which transformers keeps in fp32) on the engine's pool, each logit one thread's fp32
// FMA chain in a fixed order (kernels.h: gemm_panel), so the same values for a row whatever T is.
void router_logits_f32(const KernelTable* kt, const float* w, int64_t rows, int64_t cols, const float* x, int64_t T,
                       float* logits);

// The grouped routers of DeepSeek-V2/V3, Kimi-K2 and GLM-4.x (and MiniMax-M2's, one group), as
// models/adapters/routing.py's torch versions compute them, on fp32 logits:
struct GroupedTopk {
  bool sigmoid = true;            // scores: sigmoid of each logit, else softmax over the row
  const float* bias = nullptr;    // [experts] added to the scores for the choice (V3's correction), or none
  int n_group = 1, topk_group = 1;  // the choice stays in the topk_group best of n_group equal groups
  bool group_by_max = false;      // a group's score: its largest choice value (V2), else its two largest summed (V3)
  bool masked_zero = false;       // experts outside those groups: 0 (V2, whose weights are the masked
                                  // scores), else -inf (V3, whose weights are the unmasked scores)
  bool normalize = false;         // the k weights divided by their sum plus `eps`
  double eps = 0;
  double scaling = 1;             // then multiplied by this
};
// Each score is its exact value (double) rounded once to fp32; the choice values are those plus the
// bias as torch adds two fp32 tensors; groups and experts are picked by torch.topk(sorted=False)'s own
// algorithm on its order relation (see softmax_topk), so the same ids in the same order as the torch
// version takes. Each weight is its exact value from the exact scores, rounded once to fp32.
// ids [rows, k] int64, weights [rows, k] fp32.
void grouped_topk(const float* logits, int64_t rows, int64_t experts, int k, const GroupedTopk& spec, int64_t* ids,
                  float* weights);

}  // namespace hetmoe
