#include "expert_split.h"

#include <algorithm>
#include <numeric>

namespace hetmoe {
namespace {

// Expert e's rows [r0, r1) of `p`, codes, scales and zero points, to `node`.
void move_rows(const Proj& p, int e, int r0, int r1, int node) {
  if (r0 >= r1) return;
  const uint8_t* w = p.w + e * p.w_estride;
  move_to_node(w + r0 * p.w_rstride, w + r1 * p.w_rstride, node);
  if (p.s) {
    const uint8_t* s = p.s + e * p.s_estride;
    move_to_node(s + (r0 / p.s_row_div) * p.s_rstride, s + ((r1 + p.s_row_div - 1) / p.s_row_div) * p.s_rstride, node);
  }
  if (p.z) {
    const uint8_t* z = p.z + e * p.z_estride;
    move_to_node(z + r0 * p.z_rstride, z + r1 * p.z_rstride, node);
  }
}

}  // namespace

std::vector<int> even_bounds(int n, int unit, int parts) {
  const int units = (n + unit - 1) / unit;
  std::vector<int> bounds;
  for (int j = 0; j <= parts; ++j) bounds.push_back(std::min(n, unit * int(int64_t(units) * j / parts)));
  return bounds;
}

std::vector<NodeRows> split_experts(int E, int H, int I, const Proj& gate, const Proj& up, const Proj& down,
                                    const NumaTopology& topology) {
  const int nodes = std::max(1, topology.nodes());
  if (nodes == 1) return {NodeRows{0, I, 0, H, -1}};
  // Cuts at whole fp8 scale blocks of rows (the other methods scale rows one by one).
  const std::vector<int> up_bounds = even_bounds(I, std::lcm(gate.s_row_div, up.s_row_div), nodes);
  const std::vector<int> down_bounds = even_bounds(H, down.s_row_div, nodes);
  std::vector<NodeRows> split;
  for (int j = 0; j < nodes; ++j) {
    NodeRows r{up_bounds[j], up_bounds[j + 1], down_bounds[j], down_bounds[j + 1], topology.memory_node[j]};
    // A page shared by two nodes' rows goes to the node holding its first byte.
    if (r.memory_node >= 0) {
      for (int e = 0; e < E; ++e) {
        move_rows(gate, e, r.up0, r.up1, r.memory_node);
        move_rows(up, e, r.up0, r.up1, r.memory_node);
        move_rows(down, e, r.down0, r.down1, r.memory_node);
      }
    }
    split.push_back(r);
  }
  return split;
}

}  // namespace hetmoe
