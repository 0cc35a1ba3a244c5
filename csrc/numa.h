// The NUMA nodes the thread pool splits into, and memory placed on one of them.
//
// libnuma is loaded at run time (dlopen of libnuma.so.1), never linked, to learn which node each
// CPU is on: where it is absent, or reports one node, the pool is one group of threads and no page
// is moved. HETMOE_NUMA chooses: "auto" (the default: libnuma's nodes that hold allowed CPUs),
// "off" (one group), or a count N (the allowed CPUs split into N groups of consecutive CPUs, each
// taken for a node whose memory is the libnuma node its CPUs are on). A count exists for tests and
// experiments on one-node machines: the split engine runs exactly as it would across sockets.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace hetmoe {

constexpr int kMaxNodes = 16;  // NUMA groups the pool keeps apart; more are merged round-robin

struct NumaTopology {
  std::vector<std::vector<int>> node_cpus;  // allowed CPUs of each group, ascending
  std::vector<int> memory_node;             // the libnuma node each group's memory goes to; -1: anywhere
  std::string source;                       // "single", "libnuma" or "split"

  int nodes() const { return static_cast<int>(node_cpus.size()); }
};

// The topology for `spec` ("auto", "off" or a count; "" reads HETMOE_NUMA). Throws
// std::invalid_argument for a spec that is none of these.
NumaTopology numa_topology(const std::string& spec);
bool libnuma_loaded();
std::vector<int> allowed_cpus();  // the CPUs this process may run on

// Moves the pages that start inside [begin, end) to node `node` (move_pages(2), no memory policy
// set, so no mapping is split): pages not yet faulted in are left for whoever touches them first.
// Returns how many of those pages sit on the node afterwards, or -1 where the kernel cannot move
// pages (no NUMA support).
long move_to_node(const void* begin, const void* end, int node);

// The node the page holding `addr` is on (get_mempolicy; a page not yet touched is faulted in),
// or -1 where the kernel does not say (no NUMA support).
int page_node(const void* addr);

}  // namespace hetmoe
