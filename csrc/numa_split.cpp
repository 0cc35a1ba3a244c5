#include "numa_split.h"

#include <algorithm>
#include <numeric>

namespace hetmoe {

std::vector<int> node_bounds(int n, int unit, const NumaTopology& topology) {
  const int parts = std::max(1, topology.nodes());
  const int units = (n + unit - 1) / unit;
  std::vector<int> bounds;
  for (int j = 0; j <= parts; ++j) bounds.push_back(std::min(n, unit * int(int64_t(units) * j / parts)));
  return bounds;
}

void move_node_rows(const Proj& p, int E, const std::vector<int>& bounds, const NumaTopology& topology) {
  for (int j = 0; j + 1 < static_cast<int>(bounds.size()); ++j) {
    const int node = j < topology.nodes() ? topology.memory_node[j] : -1;
    const int r0 = bounds[j], r1 = bounds[j + 1];
    if (node < 0 || r0 >= r1) continue;
    for (int e = 0; e < E; ++e) {
      const uint8_t* w = p.w + e * p.w_estride;
      move_to_node(w + r0 * p.w_rstride, w + r1 * p.w_rstride, node);
      if (p.s) {
        const uint8_t* s = p.s + e * p.s_estride;
        const int64_t s0 = r0 / p.s_row_div, s1 = (r1 + p.s_row_div - 1) / p.s_row_div;
        move_to_node(s + s0 * p.s_rstride, s + s1 * p.s_rstride, node);
      }
      if (p.z) {
        const uint8_t* z = p.z + e * p.z_estride;
        move_to_node(z + r0 * p.z_rstride, z + r1 * p.z_rstride, node);
      }
    }
  }
}

std::vector<NodeRows> split_experts(int E, int H, int I, const Proj& gate, const Proj& up, const Proj& down,
                                    const NumaTopology& topology) {
  if (topology.nodes() <= 1) return {NodeRows{0, I, 0, H, -1}};
  // Cut at whole fp8 scale blocks of rows (the other methods scale rows one by one).
  const std::vector<int> up_rows = node_bounds(I, std::lcm(gate.s_row_div, up.s_row_div), topology);
  const std::vector<int> down_rows = node_bounds(H, down.s_row_div, topology);
  move_node_rows(gate, E, up_rows, topology);
  move_node_rows(up, E, up_rows, topology);
  move_node_rows(down, E, down_rows, topology);
  std::vector<NodeRows> split;
  for (int j = 0; j < topology.nodes(); ++j)
    split.push_back({up_rows[j], up_rows[j + 1], down_rows[j], down_rows[j + 1], topology.memory_node[j]});
  return split;
}

}  // namespace hetmoe
