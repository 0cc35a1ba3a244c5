// A plain linear layer y = x W^T (+ bias) on the CPU, W in any engine method: what a dense layer
// (attention projections, dense MLPs, shared experts, lm_head) needs, with the MoE engine's kernels
// and thread pool. It is the MoE case reduced to one expert and k = 1, written without routing:
// decode (few tokens) streams W once with the method's GEMV, prefill dequantizes W a panel of rows
// at a time and reuses each panel across all tokens with the fp32 panel GEMM. Work is split over
// the output rows N (and over tokens too when N alone gives the pool too few items); on a NUMA
// pool each node owns a slice of the rows, its pages moved to the node (numa_split.h).
#pragma once
#include <cstdint>
#include <vector>

#include "engine_common.h"
#include "kernels.h"
#include "numa_split.h"

namespace hetmoe {

class LinearEngine {
 public:
  // `bias`: fp32 [N] or nullptr. `gemv_max_tokens`: above this many tokens the GEMM path runs.
  LinearEngine(const Proj& weight, const float* bias, const KernelTable* kernels, int gemv_max_tokens);

  // Starts y [T, N] = x [T, K] W^T (+ bias); x and y in kF32 or kBF16Data, rows contiguous. The
  // pointers must stay valid until wait(). Returns a handle.
  int64_t submit(const void* x, int x_dtype, int tokens, void* y, int y_dtype);
  // Blocks until the job is done; false if the handle is not pending.
  bool wait(int64_t handle);
  int pending() const;

  int rows() const { return w_.n; }
  int cols() const { return w_.k; }
  const KernelTable* kernels() const { return kt_; }
  // Where the rows are cut per node of the pool (bounds[j] .. bounds[j + 1]; {0, N} on one node).
  const std::vector<int>& node_bounds() const { return bounds_; }

 private:
  Proj w_;
  const float* bias_;
  const KernelTable* kt_;
  int gemv_max_;
  std::vector<int> bounds_;  // by the pool's topology when the engine was made
  engine::PendingJobs jobs_;
};

}  // namespace hetmoe
