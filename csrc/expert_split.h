// How one layer's experts are split over the pool's NUMA nodes.
//
// Node j owns rows [up0, up1) of every expert's gate and up (a slice of the intermediate
// dimension) and rows [down0, down1) of every expert's down (a slice of the hidden dimension), so
// every weight belongs to exactly one node and nothing is copied or repacked: the slices' pages are
// moved to their nodes once, at load, and the engine tags each work item with the node whose rows
// it streams (thread_pool.h). The phase boundary between gate/up and down, which every thread
// passes anyway, is where the nodes exchange h (S x I floats: 24 KiB for a Qwen3-30B-A3B decode
// step). Splitting down along its columns instead (the intermediate dimension, as gate and up) would
// need a repacked copy of down per node and a sum of per-node partial outputs; its rows need neither.
#pragma once
#include <vector>

#include "kernels.h"
#include "numa.h"

namespace hetmoe {

struct NodeRows {
  int up0 = 0, up1 = 0;      // rows of gate and up
  int down0 = 0, down1 = 0;  // rows of down
  int memory_node = -1;      // the node its pages were moved to (-1: left where they were)
};

// [0, n) cut into `parts` ranges of whole `unit`s, as even as that allows (the last ends at n).
std::vector<int> even_bounds(int n, int unit, int parts);

// The layer's rows for each of the topology's nodes (one range of everything for one node), each
// node's pages moved to its memory node.
std::vector<NodeRows> split_experts(int E, int H, int I, const Proj& gate, const Proj& up, const Proj& down,
                                    const NumaTopology& topology);

}  // namespace hetmoe
