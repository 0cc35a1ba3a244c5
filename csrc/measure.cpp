#include "measure.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "moe_engine.h"
#include "numa.h"
#include "thread_pool.h"

namespace hetmoe {
namespace {

using Clock = std::chrono::steady_clock;

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Runs body(i) on `threads` pinned threads that start together; returns the wall seconds.
template <typename F>
double run_parallel(int threads, F body) {
  const std::vector<int> cpus = allowed_cpus();
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i)
    pool.emplace_back([&, i] {
      if (!cpus.empty()) pin(cpus[i % cpus.size()]);
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      body(i);
    });
  while (ready.load() < threads) std::this_thread::yield();
  const auto t0 = Clock::now();
  go.store(true);
  for (auto& t : pool) t.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

double measure_read_bandwidth(uint64_t* buf, int64_t bytes, int threads, int repeats) {
  const size_t n = size_t(bytes) / sizeof(uint64_t);
  // Touch every page from the thread that will read it (first-touch NUMA placement).
  run_parallel(threads, [&](int i) {
    const size_t lo = n * i / threads, hi = n * (i + 1) / threads;
    for (size_t j = lo; j < hi; ++j) buf[j] = j;
  });
  return measure_read_bandwidth_of(buf, bytes, threads, repeats);
}

double measure_read_bandwidth_of(const uint64_t* buf, int64_t bytes, int threads, int repeats) {
  const size_t n = size_t(bytes) / sizeof(uint64_t);
  std::vector<uint64_t> sums(threads);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const double sec = run_parallel(threads, [&](int i) {
      const size_t lo = n * i / threads, hi = n * (i + 1) / threads;
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      size_t j = lo;
      for (; j + 4 <= hi; j += 4) {  // four chains: the loads, not the adds, must be the limit
        s0 += buf[j];
        s1 += buf[j + 1];
        s2 += buf[j + 2];
        s3 += buf[j + 3];
      }
      for (; j < hi; ++j) s0 += buf[j];
      sums[i] = s0 + s1 + s2 + s3;
    });
    best = std::max(best, double(n * sizeof(uint64_t)) / sec / 1e9);
  }
  volatile uint64_t sink = 0;
  for (uint64_t s : sums) sink = sink + s;
  return best;
}

namespace {
// Sums a chunk 32 bytes at a time, prefetching 8 KiB ahead as the GEMVs ask for their rows
// (kernels_common.inc): non-temporally where the bf16 GEMVs do (the pure stream of the families,
// kPrefetchFloat), else T0. Not T1 where the GEMVs take it: this
// loop alone read 23-25 GB/s with T1 against 32-36 with T0 on the AMX Xeon, and the ceiling a decode
// row is compared with must not drop with the GEMVs' choice. AVX2 only: the engine runs nowhere
// without it.
__attribute__((target("avx2"))) uint64_t read_chunk(const uint8_t* p, int64_t chunk, bool nta) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0;
  for (int64_t o = 0; o < chunk; o += 64) {
    const char* ahead = reinterpret_cast<const char*>(p + o + 8192);
    if (nta)
      _mm_prefetch(ahead, _MM_HINT_NTA);
    else
      _mm_prefetch(ahead, _MM_HINT_T0);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 32)));
  }
  return uint64_t(_mm256_extract_epi64(_mm256_add_epi64(a0, a1), 0));
}
}  // namespace

double measure_chunked_read(const uint8_t* buf, int64_t bytes, int64_t chunk, int64_t total, int reps, uint64_t seed) {
  const int64_t slots = bytes / chunk, pieces = std::max<int64_t>(1, total / chunk);
  std::mt19937_64 rng(seed);
  std::shared_ptr<ThreadPool> pool = global_pool();
  std::vector<int64_t> offsets(pieces);
  std::vector<double> gbps;
  std::atomic<uint64_t> sink{0};
  for (int r = 0; r < reps; ++r) {
    for (auto& o : offsets) o = int64_t(rng() % uint64_t(slots)) * chunk;
    auto job = std::make_shared<ForJob>(int(pieces), [&](int i) {
      const bool nta = g_weight_prefetch[kPrefetchFloat].load(std::memory_order_relaxed) == kPrefetchNta;
      sink.fetch_add(read_chunk(buf + offsets[i], chunk, nta), std::memory_order_relaxed);
    });
    const auto t0 = Clock::now();
    pool->submit(job);
    job->wait();
    gbps.push_back(double(pieces * chunk) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  return gbps.empty() ? 0.0 : gbps[gbps.size() / 2];
}

double measure_fma_peak(const KernelTable* kernels, int threads, double seconds) {
  // Calibrate the iteration count on one thread, then run all threads together.
  float sink = 0;
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = Clock::now();
    kernels->fma_burn(iters, &sink);
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    if (sec > 0.05) {
      iters = int64_t(double(iters) * seconds / sec);
      break;
    }
    iters *= 4;
  }
  std::vector<double> flops(threads);
  std::vector<float> sinks(threads);
  const double sec = run_parallel(threads, [&](int i) { flops[i] = kernels->fma_burn(iters, &sinks[i]); });
  double total = 0;
  for (double f : flops) total += f;
  return total / sec / 1e9;
}

}  // namespace hetmoe
