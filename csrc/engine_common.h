// What the engines built on the kernel table share (MoEEngine in moe_engine.cpp, LinearEngine in
// linear_engine.cpp): activation buffers in the layout each method's GEMV reads, the work-item
// size rule, bf16 rounding, and the table of pending jobs behind submit/wait handles.
//
// Compiled with the baseline flags only (never included by an ISA unit), so these inline
// definitions are the same in every translation unit that includes them.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "cpu_features.h"
#include "kernels.h"
#include "method_traits.h"
#include "thread_pool.h"

namespace hetmoe {

enum DType : int { kF32 = 0, kBF16Data = 1 };

namespace engine {

// Job buffers of 1 MiB and more are kept for the next job instead of freed. A fresh allocation that
// large is a fresh mapping whose first touch faults in and zeroes every page: a 512-token prefill of
// a Qwen3-30B-A3B layer took 12-16 thousand page faults a forward (~60 MB of buffers), ~15% of its
// time, before. A block serves requests of half its size and up.
//
// What stays cached is bounded twice, so a server's memory stays flat however its batch shapes vary:
// a block not reused within the next kIdleGets large requests goes back to the system (a prefill of a
// length seen once no longer pins its buffers), and at most kCachedBytes stay cached. Large blocks
// are their own mappings (mmap/munmap), so what the cache lets go leaves the process at once rather
// than staying in malloc's arenas.
class BufferCache {
 public:
  static constexpr size_t kMinBytes = size_t(1) << 20, kCachedBytes = size_t(512) << 20;
  // A forward of a 48-layer model asks for ~4 large buffers a MoE layer and ~1 a dense linear at
  // prefill shapes (none at decode shapes, whose buffers are small), so ~1000 large requests are a
  // handful of prefills.
  static constexpr uint64_t kIdleGets = 1024;

  struct Block {
    void* p;
    size_t bytes;  // its true capacity: a small block's request, a large one's mapping
  };

  Block get(size_t bytes) {
    if (bytes < kMinBytes) return {::operator new(bytes, std::align_val_t(64)), bytes};
    bytes = (bytes + kPage - 1) / kPage * kPage;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++clock_;
      int best = -1;
      for (int i = 0; i < static_cast<int>(free_.size()); ++i) {
        const size_t have = free_[i].block.bytes;
        if (have >= bytes && have / 2 <= bytes && (best < 0 || have < free_[best].block.bytes)) best = i;
      }
      if (best >= 0) {
        const Block b = free_[best].block;
        cached_ -= b.bytes;
        free_.erase(free_.begin() + best);
        return b;
      }
    }
    return {map(bytes), bytes};
  }

  void put(Block b) {
    if (b.bytes < kMinBytes) {
      ::operator delete(b.p, std::align_val_t(64));
      return;
    }
    std::vector<Block> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back({b, clock_});  // stamps only grow, so free_ stays oldest first
      cached_ += b.bytes;
      size_t old = 0;
      while (old < free_.size() && (clock_ - free_[old].stamp > kIdleGets || cached_ > kCachedBytes)) {
        release.push_back(free_[old].block);
        cached_ -= free_[old].block.bytes;
        ++old;
      }
      free_.erase(free_.begin(), free_.begin() + old);
    }
    for (const Block& r : release) unmap(r);
  }

  std::vector<size_t> cached_sizes() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<size_t> sizes;
    for (const Idle& i : free_) sizes.push_back(i.block.bytes);
    return sizes;
  }

 private:
  static constexpr size_t kPage = 4096;
  static void* map(size_t bytes);
  static void unmap(const Block& b);

  struct Idle {
    Block block;
    uint64_t stamp;  // clock_ when it came back
  };
  std::mutex mu_;
  std::vector<Idle> free_;
  size_t cached_ = 0;
  uint64_t clock_ = 0;  // large requests so far
};

inline void* BufferCache::map(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

inline void BufferCache::unmap(const Block& b) { munmap(b.p, b.bytes); }

inline BufferCache& buffer_cache() {
  static BufferCache* cache = new BufferCache;  // never destroyed: jobs may finish during exit
  return *cache;
}

struct Recycle {
  size_t bytes = 0;
  void operator()(void* p) const { buffer_cache().put({p, bytes}); }
};
template <typename T>
using Buf = std::unique_ptr<T[], Recycle>;

// n uninitialised elements (at least one) from the buffer cache.
template <typename T>
Buf<T> uninit(size_t n) {
  const BufferCache::Block b = buffer_cache().get(std::max<size_t>(n, 1) * sizeof(T));
  return Buf<T>(static_cast<T*>(b.p), Recycle{b.bytes});
}

// p rounded up to the next 64-byte boundary (a buffer allocated with 64 bytes to spare).
template <typename T>
T* align64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// A scratch vector grown to at least n elements (never shrunk: per-worker buffers keep their size).
template <typename T>
T* sized(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Whether the GEMM path of a bf16 model meets its bf16 activations in the table's VDPBF16PS kernel.
inline bool bf16_dot(const KernelTable* kt) { return kt->gemm_bf16 != nullptr && cpu_features().avx512bf16; }
// Activations `x` of dtype `x_dtype` as the bf16 rows the GEMVs may read (Act::h): where they are
// bf16 and the CPU multiplies bf16 pairs; nullptr otherwise.
inline const uint16_t* bf16_x(const KernelTable* kt, const void* x, int x_dtype) {
  return x_dtype == kBF16Data && bf16_dot(kt) ? static_cast<const uint16_t*>(x) : nullptr;
}

// Rows [n0, n1) (at most kPanelRows) of expert e's weights as bf16 rows for gemm_bf16: bf16 weights
// as stored; any other method dequantized and rounded to bf16 in `f32` / `b16` (per-worker scratch),
// the weights a bf16 model holds when it dequantizes a quantized checkpoint into its dtype.
struct Bf16Rows {
  const uint16_t* w;
  int64_t stride;  // elements between rows
};
inline Bf16Rows bf16_rows(const KernelTable* kt, const Proj& p, int e, int n0, int n1, std::vector<float>& f32,
                          std::vector<uint16_t>& b16) {
  if (p.method == kBF16)
    return {reinterpret_cast<const uint16_t*>(p.w + e * p.w_estride + int64_t(n0) * p.w_rstride), p.w_rstride / 2};
  // A row at a time, so its fp32 values are rounded to bf16 while they are still in L1 (a whole
  // panel's fp32 rows, 24 x K, went out to L2 and came back).
  float* row = sized(f32, size_t(p.k));
  uint16_t* rows = sized(b16, size_t(kPanelRows) * p.k);
  for (int n = n0; n < n1; ++n) {
    kt->dequant_rows[p.method](p, e, n, n + 1, row);
    kt->f32_to_bf16(row, rows + size_t(n - n0) * p.k, p.k);
  }
  return {rows, p.k};
}

// How wide the integer GEMVs reading layout `mode` run in a job whose busiest expert (or linear) has
// `tokens` tokens: the decode regime where each GEMV call is one pass (kernels.h g_int_vector_bits).
inline int gemv_bits(int mode, int tokens) {
  const int regime = tokens <= kGemvTokens ? kWidthDecode : kWidthPrompt;
  return g_int_vector_bits[width_family(mode)][regime].load(std::memory_order_relaxed);
}

// Whether a method's GEMV activations are quantized to int8 level (g_act_one_digit: the 4- to 6-bit
// GEMVs, whatever layout their width gives them), read once a job so that all its rows are alike.
inline bool act_one_digit(int method) {
  const int mode = method_traits(method).gemv_act;
  return mode != kActNone && mode != kActNatural && g_act_one_digit.load(std::memory_order_relaxed);
}

// The activation layout each method's GEMV kernel reads (Act in kernels.h), at the width it runs in a
// job whose busiest expert (or linear) has `tokens` tokens.
inline int act_quant_for(const KernelTable* kt, int method, int K, int tokens) {
  const int mode = method_traits(method).gemv_act;
  return mode == kActNone ? kActNone : kt->act_layout(mode, K, gemv_bits(mode, tokens));
}

inline float bf16_to_f32(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// Rows of a projection one work item covers: whole panels, up to ~1 MiB of weights, so that the
// cost of claiming an item and of a stream's first DRAM misses stays small next to streaming it
// (decode items are pure streaming), in items of equal size, at least `min_items` of them over the
// n rows where there are panels enough (a pool of many threads still gets work for each).
// Measured on a Zen 5 (2 threads, Qwen3-30B-A3B layer, 1-token decode from DRAM, in-process A/B):
// 256 KiB -> 1 MiB took int4 0.48-0.53 -> 0.42-0.50 ms, int8 0.86-1.03 -> 0.83-1.00 ms, bf16
// 1.23-1.60 -> 1.11-1.59 ms, no further gain at 2 or 4 MiB; prefill at 32-512 tokens level or
// 1-8% faster. (32 KiB -> 256 KiB had taken int4 0.779 -> 0.723 ms.)
constexpr int64_t kItemBytes = 1 << 20;
inline int item_rows(const Proj& p, int n, int min_items) {
  const double bytes = double(n) * p.k * method_traits(p.method).bits_per_weight / 8;
  const int panels = (n + kPanelRows - 1) / kPanelRows;
  const int items = std::min(panels, std::max(min_items, static_cast<int>((bytes + kItemBytes - 1) / kItemBytes)));
  return ((panels + items - 1) / items) * kPanelRows;
}

// A phase's items over the pool's NUMA nodes (numa_split.h): node j's rows [r0, r1) of a weight in
// blocks of `rows`, once per repetition (a MoE job's active experts, a linear job's token chunks),
// as items [first, first + reps * chunks), repetition by repetition. With several nodes the phase
// tags each node's items (thread_pool.h: a node's threads take its own first).
struct NodeRowItems {
  struct Node {
    int r0, r1, rows, chunks, first;
  };
  std::vector<Node> nodes;
  int reps = 0;

  void add(int r0, int r1, int rows) { nodes.push_back({r0, r1, rows, (r1 - r0 + rows - 1) / rows, 0}); }
  int chunks() const {
    int n = 0;
    for (const Node& node : nodes) n += node.chunks;
    return n;
  }
  int max_rows() const {
    int n = 0;
    for (const Node& node : nodes) n = std::max(n, node.rows);
    return n;
  }
  void repeat(int n) {
    reps = n;
    for (size_t j = 1; j < nodes.size(); ++j) nodes[j].first = nodes[j - 1].first + nodes[j - 1].chunks * reps;
  }
  int items() const { return nodes.empty() ? 0 : nodes.back().first + nodes.back().chunks * reps; }

  Phase phase(std::function<void(int item, int worker)> run) const {
    Phase p{items(), std::move(run)};
    if (nodes.size() > 1) {
      p.shards = static_cast<int>(nodes.size());
      for (int j = 0; j < p.shards; ++j) p.shard_first[j] = nodes[j].first;
      p.shard_first[p.shards] = p.items;
    }
    return p;
  }

  // The repetition and the rows [first, last) of an item.
  void locate(int item, int& rep, int& first, int& last) const {
    int j = static_cast<int>(nodes.size()) - 1;
    while (j > 0 && item < nodes[j].first) --j;  // a node without items never holds the item
    const Node& node = nodes[j];
    item -= node.first;
    rep = item / node.chunks;
    first = node.r0 + (item % node.chunks) * node.rows;
    last = std::min(node.r1, first + node.rows);
  }
};

// Whether the bf16 GEMV on bf16 activations (kWidthFloat) runs 512 bits wide in a job whose busiest
// expert (or linear) has `tokens` tokens.
inline bool float_gemv_wide(int tokens) { return gemv_bits(kActNone, tokens) == 512; }

// Activation rows in the layout a method's GEMV kernel wants.
struct ActBuffers {
  int K = 0, mode = kActNone;
  bool one_digit = false;  // the codes at int8 level (act_one_digit of the method the rows are for)
  bool wide = false;  // Act::wide: mode's 512-bit layouts, or for a float GEMV (kActNone) float_gemv_wide
  Buf<int16_t> q;
  Buf<float> d;
  Buf<int32_t> sum;

  void allocate(int rows, int k, int m, bool one = false, bool wide_float = false) {
    K = k;
    mode = m;
    one_digit = one && mode != kActNone;
    wide = mode == kActNone ? wide_float : act_is_wide(mode);
    if (mode == kActNone) return;
    q = uninit<int16_t>(size_t(rows) * K);
    d = uninit<float>(size_t(rows) * (K / kActBlock));
    sum = uninit<int32_t>(size_t(rows) * act_sums(mode, K));
  }
  void quantize(const KernelTable* kt, const float* row, int r) {
    if (mode == kActNone) return;
    const size_t nb = K / kActBlock;
    kt->quantize_row(row, K, mode, q.get() + size_t(r) * K, d.get() + r * nb, sum.get() + r * act_sums(mode, K),
                     one_digit);
  }
  Act act(const float* row, int r) const {
    Act a;
    a.f = row;
    a.wide = wide;
    a.one_digit = one_digit;
    if (mode != kActNone) {
      const size_t nb = K / kActBlock;
      a.q = q.get() + size_t(r) * K;
      a.d = d.get() + r * nb;
      a.sum = sum.get() + r * act_sums(mode, K);
    }
    return a;
  }
};

// Jobs submitted by one engine and not yet waited on, by handle.
class PendingJobs {
 public:
  int64_t add(std::shared_ptr<Job> job) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t handle = next_++;
    jobs_[handle] = std::move(job);
    return handle;
  }
  // The job for `handle`, removed from the table; nullptr if it is not pending.
  std::shared_ptr<Job> take(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(handle);
    if (it == jobs_.end()) return nullptr;
    std::shared_ptr<Job> job = std::move(it->second);
    jobs_.erase(it);
    return job;
  }
  // Blocks until the job for `handle` is done and forgets it; false if it is not pending.
  bool wait(int64_t handle) {
    std::shared_ptr<Job> job = take(handle);
    if (!job) return false;
    job->wait();
    return true;
  }
  int size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(jobs_.size());
  }

 private:
  mutable std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Job>> jobs_;
  int64_t next_ = 1;
};

}  // namespace engine
}  // namespace hetmoe
