#include "routing.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "engine_common.h"

namespace hetmoe {

void softmax_topk(const void* logits, int dtype, int64_t rows, int64_t experts, int k, bool normalize,
                  bool round_bf16, int64_t* ids, float* weights) {
  thread_local std::vector<std::pair<double, int64_t>> queue;
  queue.resize(experts);
  // torch.topk's order relation (aten's TopKImpl.h): larger first, a NaN above every number
  const auto before = [](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < experts; ++e) {
      const double v = dtype == kBF16Data ? engine::bf16_to_f32(static_cast<const uint16_t*>(logits)[r * experts + e])
                                         : static_cast<const float*>(logits)[r * experts + e];
      queue[e] = {v, e};
    }
    // The k largest as torch.topk(sorted=True) picks them on a CPU: its algorithm on its order relation
    // over the same sequence (softmax keeps the logits' order and their ties), so equal logits end in
    // the same places: the same experts as transformers' routers take at a tie, which bf16 logits of
    // 128 experts meet at the k-th place in about one token of six.
    if (int64_t(k) * 64 <= experts) {
      std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
    } else {
      std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), before);
      std::sort(queue.begin(), queue.begin() + (k - 1), before);
    }
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

}  // namespace hetmoe
