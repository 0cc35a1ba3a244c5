#include "cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace hetmoe {
namespace {

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

// Linux: a process must ask before using AMX tile data (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
  f.amd = std::strcmp(vendor, "AuthenticAMD") == 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  const bool osxsave = c & (1u << 27);
  if (osxsave) {
    const uint64_t xcr0 = xgetbv0();
    f.os_ymm = (xcr0 & 0x6) == 0x6;
    f.os_zmm = (xcr0 & 0xE6) == 0xE6;
    f.os_amx = (xcr0 & 0x60000) == 0x60000;
  }
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    f.avx512f = b & (1u << 16);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512vbmi = c & (1u << 1);
    f.avx512vnni = c & (1u << 11);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    f.amx_int8 = d & (1u << 25);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512bf16 = a & (1u << 5);
  }
  if (f.amx_tile && f.os_amx) f.os_amx = request_amx_permission();
  const long l1d = sysconf(_SC_LEVEL1_DCACHE_SIZE);  // glibc reads it from CPUID; 0 or -1 if unknown
  if (l1d > 0) f.l1d_bytes = int(l1d);
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

int default_int_vector_bits() {
  const CpuFeatures& f = cpu_features();
  return f.amd && f.can_avx512() ? 512 : 256;
}

std::atomic<int> g_int_vector_bits[kWidthFamilies][kWidthRegimes] = {
    {default_int_vector_bits(), default_int_vector_bits()},
    {default_int_vector_bits(), default_int_vector_bits()},
    {default_int_vector_bits(), default_int_vector_bits()}};
int default_weight_prefetch() { return cpu_features().amd ? kPrefetchNta : kPrefetchT0; }

std::atomic<int> g_weight_prefetch[kPrefetchFamilies] = {default_weight_prefetch(), default_weight_prefetch(),
                                                         default_weight_prefetch()};
std::atomic<bool> g_act_one_digit{false};
const int g_fp32_x_shared_min_k = cpu_features().l1d_bytes / 2 / int(sizeof(float));

}  // namespace hetmoe
