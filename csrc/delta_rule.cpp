#include "delta_rule.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "engine_common.h"
#include "moe_engine.h"  // global_pool()
#include "thread_pool.h"

namespace hetmoe {

namespace {

void widen(const KernelTable* kt, const void* src, int dtype, int64_t n, float* dst) {
  if (dtype == kBF16Data)
    kt->bf16_to_f32(static_cast<const uint16_t*>(src), dst, int(n));
  else
    std::memcpy(dst, src, size_t(n) * sizeof(float));
}

// l2norm as transformers computes it: x * rsqrt(sum(x * x) + eps)
void l2_normalise(float* x, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace

void gated_delta_step(const KernelTable* kt, const void* q, const void* k, const void* v, int dtype, const float* g,
                      const float* beta, float* state, void* out, int64_t k_heads, int64_t v_heads, int64_t dk,
                      int64_t dv) {
  const size_t elem = dtype == kBF16Data ? 2 : 4;
  const int64_t per_key = v_heads / k_heads;
  const float q_scale = std::sqrt(float(dk));
  auto job = std::make_shared<ForJob>(int(v_heads), [=](int h) {
    thread_local std::vector<float> qf, kf, vf, mem;
    qf.resize(dk);
    kf.resize(dk);
    vf.resize(dv);
    mem.assign(dv, 0.f);
    const int64_t kh = h / per_key;
    widen(kt, static_cast<const uint8_t*>(q) + size_t(kh) * dk * elem, dtype, dk, qf.data());
    widen(kt, static_cast<const uint8_t*>(k) + size_t(kh) * dk * elem, dtype, dk, kf.data());
    widen(kt, static_cast<const uint8_t*>(v) + size_t(h) * dv * elem, dtype, dv, vf.data());
    l2_normalise(qf.data(), dk);
    l2_normalise(kf.data(), dk);
    for (int64_t i = 0; i < dk; ++i) qf[i] /= q_scale;
    float* s = state + size_t(h) * dk * dv;
    const float decay = std::exp(g[h]);
    // decay the state and read its memory of k: kv_mem[j] = sum_i S[i][j] k[i]
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv;
      const float ki = kf[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] *= decay;
        mem[j] += row[j] * ki;
      }
    }
    for (int64_t j = 0; j < dv; ++j) mem[j] = (vf[j] - mem[j]) * beta[h];  // delta
    // write k delta^T into the state and read it with q: out[j] = sum_i S[i][j] q[i]
    std::vector<float>& o = vf;  // v is no longer needed
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv;
      const float ki = kf[i], qi = qf[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] += ki * mem[j];
        o[j] += row[j] * qi;
      }
    }
    if (dtype == kBF16Data)
      kt->f32_to_bf16(o.data(), static_cast<uint16_t*>(out) + size_t(h) * dv, int(dv));
    else
      std::memcpy(static_cast<float*>(out) + size_t(h) * dv, o.data(), size_t(dv) * sizeof(float));
  });
  global_pool()->submit(job);
  job->wait();
}

}  // namespace hetmoe
