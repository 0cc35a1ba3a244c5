// What this CPU and OS can run, from CPUID and XGETBV; AMX only after the kernel grants it.
#pragma once
#include <string>

namespace hetmoe {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false, avx512bf16 = false;
  bool avx512vbmi = false;  // VPERMB, VPMULTISHIFTQB: the AMX unit's 4-bit digit decode
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  bool os_ymm = false, os_zmm = false, os_amx = false;  // the OS saves that register state
  bool amd = false;                                     // vendor "AuthenticAMD"
  int l1d_bytes = 32 << 10;                             // one core's L1 data cache (the OS's figure)

  bool can_avx2() const { return avx2 && fma && f16c && os_ymm; }
  bool can_avx512() const { return can_avx2() && avx512f && avx512bw && avx512vl && avx512vnni && os_zmm; }
  // the AMX kernels' AVX-512 code (kernels_amx.cpp), which the tile emulator runs as well
  bool can_amx_vector() const { return can_avx512() && avx512bf16 && avx512vbmi; }
  bool can_amx() const { return can_amx_vector() && amx_tile && amx_bf16 && amx_int8 && os_amx; }
};

// Detected once; the AMX permission request happens on first call.
const CpuFeatures& cpu_features();

// The default of g_int_vector_bits (kernels.h): 512 on AMD CPUs with AVX-512, else 256.
int default_int_vector_bits();
// The default of g_weight_prefetch (kernels.h) where the tuner has not chosen: non-temporal on AMD
// (measured faster on Zen 5), T0 elsewhere.
int default_weight_prefetch();

}  // namespace hetmoe
