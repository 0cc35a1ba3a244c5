// How weights are split over the pool's NUMA nodes: by rows, each row owned by one node.
//
// A MoE layer (MoEEngine): node j owns rows [up0, up1) of every expert's gate and up (a slice of
// the intermediate dimension) and rows [down0, down1) of every expert's down (a slice of the hidden
// dimension). A linear layer (LinearEngine): node j owns a slice of its output rows. Every weight
// belongs to exactly one node and nothing is copied or repacked: the slices' pages are moved to
// their nodes once, at load, and the engines tag each work item with the node whose rows it
// streams (thread_pool.h). In a MoE layer the phase boundary between gate/up and down, which every
// thread passes anyway, is where the nodes exchange h (S x I floats: 24 KiB for a Qwen3-30B-A3B
// decode step). Splitting down along its columns instead (the intermediate dimension, as gate and
// up) would need a repacked copy of down per node and a sum of per-node partial outputs (and, cut
// to 384 columns for two nodes of a Qwen3-30B-A3B layer, it ran the 256-bit loops: int4 decode
// 0.80-0.92 ms against 0.57 unsplit on a Zen 5); its rows need neither.
#pragma once
#include <vector>

#include "kernels.h"
#include "numa.h"

namespace hetmoe {

// Where [0, n) is cut for each of the topology's nodes: bounds[j] .. bounds[j + 1] in whole `unit`s,
// as even as that allows ({0, n} for one node).
std::vector<int> node_bounds(int n, int unit, const NumaTopology& topology);

// Each node's rows [bounds[j], bounds[j + 1]) of experts [0, E) of `p` (codes, scales, zero
// points) moved to the node's memory (move_to_node: a page shared by two nodes' rows goes to the
// node holding its first byte). Nothing moves for a group without a memory node.
void move_node_rows(const Proj& p, int E, const std::vector<int>& bounds, const NumaTopology& topology);

struct NodeRows {
  int up0 = 0, up1 = 0;      // rows of gate and up
  int down0 = 0, down1 = 0;  // rows of down
  int memory_node = -1;      // the node its pages were moved to (-1: left where they were)
};

// A MoE layer's rows for each of the topology's nodes (one range of everything for one node), each
// node's pages moved to its memory node.
std::vector<NodeRows> split_experts(int E, int H, int I, const Proj& gate, const Proj& up, const Proj& down,
                                    const NumaTopology& topology);

}  // namespace hetmoe
