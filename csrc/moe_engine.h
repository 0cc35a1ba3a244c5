// One MoE layer's routed experts on the CPU: routing, the phases of a forward, async jobs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine_common.h"
#include "numa_split.h"
#include "kernels.h"
#include "thread_pool.h"

namespace hetmoe {

enum ActKind : int { kSiluMul = 0, kSwigluOAI = 1 };

// The expert MLP's activation and optional biases (fp32, [E, I] for gate/up and [E, H] for down;
// nullptr when absent): gpt-oss adds biases and uses its clamped SwiGLU.
struct ActConfig {
  int kind = kSiluMul;
  float alpha = 1.702f, limit = 7.0f;
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
};

class MoEEngine {
 public:
  MoEEngine(int experts, int hidden, int intermediate, const Proj& gate, const Proj& up, const Proj& down,
            const ActConfig& act, const KernelTable* kernels, int gemv_max_tokens);

  // Starts a forward; the pointers must stay valid until wait(). Returns a handle.
  int64_t submit(const void* x, int x_dtype, int tokens, const int64_t* ids, int topk, const float* weights,
                 void* y, const uint8_t* skip_mask);
  // Blocks until the job is done; false if the handle is not pending.
  bool wait(int64_t handle);
  // submit and wait in one: the caller's thread runs the job's items with the pool's as wait() does,
  // with no handle kept.
  void forward(const void* x, int x_dtype, int tokens, const int64_t* ids, int topk, const float* weights, void* y,
               const uint8_t* skip_mask);
  int pending() const;

  int experts() const { return E_; }
  const KernelTable* kernels() const { return kt_; }
  // The rows each of the pool's NUMA nodes owns (one entry, all rows, on a one-node pool).
  const std::vector<NodeRows>& split() const { return split_; }

 private:
  int E_, H_, I_;
  Proj gate_, up_, down_;
  ActConfig act_;
  const KernelTable* kt_;
  int gemv_max_;
  std::vector<NodeRows> split_;  // by the pool's topology when the engine was made
  engine::PendingJobs jobs_;

  // The job of one forward, made and handed to the pool.
  std::shared_ptr<Job> start(const void* x, int x_dtype, int tokens, const int64_t* ids, int topk,
                             const float* weights, void* y, const uint8_t* skip_mask);
};

// The process-wide pool all engines share; created on first use.
std::shared_ptr<ThreadPool> global_pool();
void set_pool_threads(int threads);
int pool_threads();
// How the next pool splits into NUMA nodes: "auto", "off" or a count (numa.h); "" reads HETMOE_NUMA.
// Engines made afterwards split their experts that way. Throws std::invalid_argument for a bad spec.
void set_pool_numa(const std::string& spec);

}  // namespace hetmoe
