#include "routing.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "engine_common.h"
#include "moe_engine.h"  // global_pool
#include "thread_pool.h"

namespace hetmoe {

namespace {

using Entry = std::pair<double, int64_t>;  // (value, index): torch.topk's queue

// torch.topk's order relation (aten's TopKImpl.h): larger first, a NaN above every number
bool before(const Entry& a, const Entry& b) {
  return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
}

// The k largest of `queue` into its first k places as torch.topk puts them on a CPU: its algorithm
// on its order relation over the same sequence, so equal values end in the same places (the same
// experts as transformers' routers take at a tie). `sorted`: largest first, as topk(sorted=True).
void torch_topk(std::vector<Entry>& queue, int64_t k, bool sorted) {
  if (k * 64 <= int64_t(queue.size())) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
  } else {
    std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), before);
    if (sorted) std::sort(queue.begin(), queue.begin() + (k - 1), before);
  }
}

}  // namespace

void softmax_topk(const void* logits, int dtype, int64_t rows, int64_t experts, int k, bool normalize,
                  bool round_bf16, int64_t* ids, float* weights) {
  thread_local std::vector<Entry> queue;
  queue.resize(experts);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < experts; ++e) {
      const double v = dtype == kBF16Data ? engine::bf16_to_f32(static_cast<const uint16_t*>(logits)[r * experts + e])
                                         : static_cast<const float*>(logits)[r * experts + e];
      queue[e] = {v, e};
    }
    // The k largest of the logits as torch.topk(sorted=True) takes them from the probabilities (softmax
    // keeps the logits' order and their ties, which bf16 logits of 128 experts meet at the k-th place
    // in about one token of six)
    torch_topk(queue, k, true);
    const double top = queue[0].first;  // the row's maximum (or NaN: then every weight is NaN)
    double sum = 0;
    if (normalize) {
      for (int i = 0; i < k; ++i) sum += std::exp(queue[i].first - top);
    } else {
      for (int64_t e = 0; e < experts; ++e) sum += std::exp(queue[e].first - top);
    }
    for (int i = 0; i < k; ++i) {
      float w = float(std::exp(queue[i].first - top) / sum);
      if (round_bf16) w = engine::bf16_to_f32(engine::f32_to_bf16(w));
      ids[r * k + i] = queue[i].second;
      weights[r * k + i] = w;
    }
  }
}

void router_logits_f32(const KernelTable* kt, const float* w, int64_t rows, int64_t cols, const float* x, int64_t T,
                       float* logits) {
  constexpr int64_t kRows = 16;  // rows an item: 64 experts are 4 items, 256 are 16
  const int64_t items = (rows + kRows - 1) / kRows;
  thread_local std::vector<const float*> a;
  a.resize(T);
  for (int64_t t = 0; t < T; ++t) a[t] = x + t * cols;
  const float* const* xs = a.data();
  auto job = std::make_shared<ForJob>(int(items), [=](int item) {
    const int64_t r0 = item * kRows, r1 = std::min(rows, r0 + kRows);
    kt->gemm_panel(w + r0 * cols, int(r1 - r0), int(cols), xs, int(T), logits + r0, int(rows));
  });
  global_pool()->submit(job);
  job->wait();
}

void grouped_topk(const float* logits, int64_t rows, int64_t experts, int k, const GroupedTopk& spec, int64_t* ids,
                  float* weights) {
  const int64_t groups = spec.n_group, per_group = experts / groups;
  const bool limit = spec.topk_group < groups;
  thread_local std::vector<double> score;  // exact
  thread_local std::vector<float> choice;  // the fp32 score (+ bias) torch chooses by
  thread_local std::vector<Entry> queue, group_queue;
  thread_local std::vector<uint8_t> allowed;
  score.resize(experts);
  choice.resize(experts);
  queue.resize(experts);
  group_queue.resize(groups);
  allowed.resize(groups);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * experts;
    if (spec.sigmoid) {
      for (int64_t e = 0; e < experts; ++e) score[e] = 1.0 / (1.0 + std::exp(-double(x[e])));
    } else {
      double top = x[0], sum = 0;
      for (int64_t e = 1; e < experts; ++e) top = std::max(top, double(x[e]));
      for (int64_t e = 0; e < experts; ++e) sum += score[e] = std::exp(double(x[e]) - top);
      for (int64_t e = 0; e < experts; ++e) score[e] /= sum;
    }
    for (int64_t e = 0; e < experts; ++e) choice[e] = spec.bias ? float(score[e]) + spec.bias[e] : float(score[e]);
    if (limit) {  // the groups torch.topk(group_scores, topk_group, sorted=False) takes
      for (int64_t g = 0; g < groups; ++g) {
        const float* c = choice.data() + g * per_group;
        float first = c[0], second = -INFINITY;  // the group's largest and second largest (topk(2)'s values)
        for (int64_t i = 1; i < per_group; ++i) {
          if (c[i] > first) {
            second = first;
            first = c[i];
          } else if (c[i] > second) {
            second = c[i];
          }
        }
        group_queue[g] = {spec.group_by_max ? first : double(first + second), g};
        allowed[g] = 0;
      }
      torch_topk(group_queue, spec.topk_group, false);
      for (int g = 0; g < spec.topk_group; ++g) allowed[group_queue[g].second] = 1;
    }
    for (int64_t e = 0; e < experts; ++e) {
      const bool out = limit && !allowed[e / per_group];
      queue[e] = {out ? (spec.masked_zero ? 0.0 : -INFINITY) : double(choice[e]), e};
    }
    torch_topk(queue, k, false);
    // V2 weighs by the masked scores (0 outside the groups), V3 by the unmasked ones
    const auto weight_of = [&](int64_t e) {
      return spec.masked_zero && limit && !allowed[e / per_group] ? 0.0 : score[e];
    };
    double sum = 0;
    if (spec.normalize)
      for (int i = 0; i < k; ++i) sum += weight_of(queue[i].second);
    const double factor = spec.normalize ? spec.scaling / (sum + spec.eps) : spec.scaling;
    for (int i = 0; i < k; ++i) {
      ids[r * k + i] = queue[i].second;
      weights[r * k + i] = float(weight_of(queue[i].second) * factor);
    }
  }
}

}  // namespace hetmoe
