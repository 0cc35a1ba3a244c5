// One token of the gated delta rule (Qwen3-Next's linear attention, transformers'
// torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel) for one sequence, in place on the
// recurrent state: per value head h (its query/key head h / (Hv / Hk), as repeat_interleave pairs them),
// in fp32, q and k L2-normalised (eps 1e-6) and q divided by sqrt(dk), then
//   S_h *= exp(g_h);  delta = (v_h - S_h^T k) * beta_h;  S_h += k delta^T;  out_h = S_h^T q.
// The sums run in another order than torch's reductions (the products are the same fp32 values), so
// results agree to fp32 summation rounding, not bit for bit. Heads are items over the engine's pool.
#pragma once
#include <cstdint>

#include "kernels.h"

namespace hetmoe {

// q, k [Hk, dk] and v [Hv, dv] in `dtype` (0 fp32, 1 bf16); g, beta [Hv] fp32; state [Hv, dk, dv]
// fp32, updated; out [Hv, dv] in `dtype`.
void gated_delta_step(const KernelTable* kt, const void* q, const void* k, const void* v, int dtype, const float* g,
                      const float* beta, float* state, void* out, int64_t k_heads, int64_t v_heads, int64_t dk,
                      int64_t dv);

}  // namespace hetmoe
