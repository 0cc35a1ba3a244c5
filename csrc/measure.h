// Machine measurements for `hetmoe doctor`: sustained read bandwidth and peak FMA throughput.
#pragma once
#include <cstdint>

#include "kernels.h"

namespace hetmoe {

// Best-of-`repeats` GB/s reading the caller's `bytes` buffer (larger than the last-level cache, not
// yet touched) with `threads` pinned threads, each first touching, then streaming, its own slice.
double measure_read_bandwidth(uint64_t* buf, int64_t bytes, int threads, int repeats);
// The same over a buffer the caller holds (already touched), so repeated samples pay no page faults.
double measure_read_bandwidth_of(const uint64_t* buf, int64_t bytes, int threads, int repeats);

// Median GB/s of `reps` reads of `total` bytes in `chunk`-byte pieces at random chunk-aligned offsets
// of the caller's buffer (`bytes`, far larger than the caches), the pieces shared out by the
// engine's thread pool and read with its weight prefetching: what a decode step's expert streams
// could reach with no arithmetic at all.
double measure_chunked_read(const uint8_t* buf, int64_t bytes, int64_t chunk, int64_t total, int reps, uint64_t seed);

// GFLOP/s of independent fp32 FMA chains on `threads` threads for about `seconds`.
double measure_fma_peak(const KernelTable* kernels, int threads, double seconds);

}  // namespace hetmoe
