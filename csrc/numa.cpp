#include "numa.h"

#include <dlfcn.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <stdexcept>

namespace hetmoe {
namespace {

// The few libnuma calls used, resolved once from libnuma.so.1 if the system has it.
struct LibNuma {
  int (*available)() = nullptr;
  int (*node_of_cpu)(int) = nullptr;
  bool ok = false;
};

template <typename F>
void resolve(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
}

const LibNuma& libnuma() {
  static const LibNuma lib = [] {
    LibNuma l;
    void* h = dlopen("libnuma.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) return l;
    resolve(h, "numa_available", l.available);
    resolve(h, "numa_node_of_cpu", l.node_of_cpu);
    // numa_available() is -1 where the kernel has no NUMA support; nothing else may be called then.
    l.ok = l.available && l.node_of_cpu && l.available() >= 0;
    return l;
  }();
  return lib;
}

NumaTopology single(const std::vector<int>& cpus) {
  NumaTopology t;
  t.node_cpus.push_back(cpus);
  t.memory_node.push_back(-1);
  t.source = "single";
  return t;
}

// The libnuma node all of `cpus` are on, or -1 if they span several (or libnuma is absent).
int common_node(const std::vector<int>& cpus) {
  const LibNuma& lib = libnuma();
  if (!lib.ok || cpus.empty()) return -1;
  const int node = lib.node_of_cpu(cpus[0]);
  for (int c : cpus)
    if (lib.node_of_cpu(c) != node) return -1;
  return node;
}

}  // namespace

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

bool libnuma_loaded() { return libnuma().ok; }

NumaTopology numa_topology(const std::string& spec_in) {
  std::string spec = spec_in;
  if (spec.empty()) {
    const char* env = std::getenv("HETMOE_NUMA");
    spec = env != nullptr && *env != '\0' ? env : "auto";
  }
  const std::vector<int> cpus = allowed_cpus();
  if (spec == "off") return single(cpus);
  if (spec == "auto") {
    const LibNuma& lib = libnuma();
    if (!lib.ok) return single(cpus);
    std::map<int, std::vector<int>> by_node;
    for (int c : cpus) by_node[std::max(0, lib.node_of_cpu(c))].push_back(c);
    if (by_node.size() < 2) return single(cpus);
    NumaTopology t;
    t.source = "libnuma";
    for (auto& [node, list] : by_node) {
      if (t.nodes() < kMaxNodes) {
        t.node_cpus.push_back(list);
        t.memory_node.push_back(node);
      } else {  // more nodes than groups: share a group (its memory then goes anywhere)
        const int g = int(node % kMaxNodes);
        t.node_cpus[g].insert(t.node_cpus[g].end(), list.begin(), list.end());
        std::sort(t.node_cpus[g].begin(), t.node_cpus[g].end());
        t.memory_node[g] = -1;
      }
    }
    return t;
  }
  char* end = nullptr;
  const long n = std::strtol(spec.c_str(), &end, 10);
  if (end == spec.c_str() || *end != '\0' || n < 1 || n > kMaxNodes)
    throw std::invalid_argument("HETMOE_NUMA: expected 'auto', 'off' or a node count from 1 to " +
                                std::to_string(kMaxNodes) + ", found '" + spec + "'");
  const int groups = int(n);
  if (groups == 1) return single(cpus);
  NumaTopology t;
  t.source = "split";
  for (int g = 0; g < groups; ++g) {
    // Consecutive CPUs, as even as the count allows. More groups than CPUs leaves some without
    // any: their shards' items then run on the other groups' threads (tests use that).
    const size_t first = cpus.size() * g / groups, last = cpus.size() * (g + 1) / groups;
    t.node_cpus.emplace_back(cpus.begin() + first, cpus.begin() + last);
    t.memory_node.push_back(common_node(t.node_cpus.back()));
  }
  return t;
}

long move_to_node(const void* begin, const void* end, int node) {
  constexpr int kMoveFlag = 2;  // MPOL_MF_MOVE: pages mapped by this process only
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  uintptr_t at = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t stop = reinterpret_cast<uintptr_t>(end);
  long placed = 0;
  std::vector<void*> pages;
  std::vector<int> nodes, status;
  while (at < stop) {
    pages.clear();
    for (; at < stop && pages.size() < 4096; at += page) pages.push_back(reinterpret_cast<void*>(at));
    nodes.assign(pages.size(), node);
    status.assign(pages.size(), -1);
    if (syscall(SYS_move_pages, 0, pages.size(), pages.data(), nodes.data(), status.data(), kMoveFlag) < 0 &&
        errno == ENOSYS)
      return -1;
    for (int st : status) placed += st == node;
  }
  return placed;
}

int page_node(const void* addr) {
  constexpr unsigned long kNode = 1, kAddr = 2;  // MPOL_F_NODE, MPOL_F_ADDR
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0, addr, kNode | kAddr) != 0) return -1;
  return node;
}

}  // namespace hetmoe
