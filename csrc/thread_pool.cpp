#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

namespace hetmoe {

void Job::wait() {
  if (finished()) return;
  if (std::shared_ptr<ThreadPool> pool = pool_.lock()) {
    pool->help_until(*this);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_.load(std::memory_order_acquire); });
}

void Job::finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

namespace {

// Lets `thread` run on every CPU of `allowed` but `avoid` (when that leaves any).
void set_affinity(pthread_t thread, const std::vector<int>& allowed, int avoid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int count = 0;
  for (int c : allowed)
    if (c != avoid) {
      CPU_SET(c, &set);
      ++count;
    }
  if (count > 0) pthread_setaffinity_np(thread, sizeof(set), &set);  // best effort
}

}  // namespace

// Between phases of a job the next one is published within microseconds (after the last job,
// workers spin idle_spin_us instead: see the header).
constexpr auto kPhaseSpin = std::chrono::microseconds(100);

ThreadPool::ThreadPool(int threads, NumaTopology topology)
    : threads_(std::max(1, threads)), topology_(std::move(topology)) {
  if (topology_.nodes() == 0) topology_ = numa_topology("off");
  for (int g = 0; g < topology_.nodes(); ++g)
    for (int c : topology_.node_cpus[g]) {
      if (c >= int(cpu_node_.size())) cpu_node_.resize(c + 1, -1);
      cpu_node_[c] = g;
    }
  // Participants per node in proportion to its CPUs (largest remainders first), the caller counted
  // on the node it runs on now.
  const int nodes = topology_.nodes();
  size_t cpus = 0;
  for (const auto& list : topology_.node_cpus) cpus += list.size();
  std::vector<int> quota(nodes, 0);
  std::vector<std::pair<size_t, int>> remainders;
  int given = 0;
  for (int g = 0; g < nodes; ++g) {
    const size_t share = size_t(threads_) * topology_.node_cpus[g].size();
    quota[g] = cpus ? int(share / cpus) : (g == 0 ? threads_ : 0);
    given += quota[g];
    remainders.push_back({cpus ? share % cpus : 0, -g});
  }
  std::sort(remainders.rbegin(), remainders.rend());
  for (int i = 0; given < threads_; ++i, ++given) ++quota[-remainders[i % nodes].second];
  int caller = caller_node();
  if (quota[caller] == 0) caller = int(std::max_element(quota.begin(), quota.end()) - quota.begin());
  --quota[caller];
  for (int g = 0; g < nodes; ++g)
    for (int i = 0; i < quota[g]; ++i) worker_node_.push_back(g);
  for (int i = 0; i + 1 < threads_; ++i) {
    workers_.emplace_back([this, i] { worker_main(i); });
    // Named (for `top -H`, and for tests that check where workers may run) and kept to their node's
    // CPUs from the start; a worker's first job then also keeps it off the caller's CPU.
    const pthread_t handle = workers_.back().native_handle();
    const std::string name = "hetmoe-n" + std::to_string(worker_node_[i]) + "-" + std::to_string(i);
    pthread_setname_np(handle, name.substr(0, 15).c_str());
    set_affinity(handle, topology_.node_cpus[worker_node_[i]], -1);
  }
}

int ThreadPool::caller_node() const {
  const int cpu = sched_getcpu();
  return cpu >= 0 && cpu < int(cpu_node_.size()) ? std::max(0, cpu_node_[cpu]) : 0;
}

void ThreadPool::drain() {
  // The caller's share of the work: with no workers (a pool of one) nobody else would run it.
  for (;;) {
    std::shared_ptr<PhaseState> st;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!state_ && queue_.empty()) return;
      st = state_;
    }
    if (!st || !run_items(st, threads_ - 1)) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

ThreadPool::~ThreadPool() {
  // Let submitted work finish first: a waiter must never be left hanging on a job the pool dropped.
  drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::note_caller_cpu() {
  const int cpu = sched_getcpu();
  if (cpu >= 0 && cpu != caller_cpu_.load(std::memory_order_relaxed)) caller_cpu_.store(cpu, std::memory_order_relaxed);
}

void ThreadPool::submit(std::shared_ptr<Job> job) {
  job->pool_ = weak_from_this();
  note_caller_cpu();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_) {
      queue_.push_back(std::move(job));
      return;
    }
    publish_locked(std::move(job), 0);
  }
  cv_.notify_all();
}

void ThreadPool::publish_locked(std::shared_ptr<Job> job, int index) {
  // Skip empty phases; a job whose phases are all done is finished here and the next queued
  // job (if any) starts.
  while (job) {
    Phase phase = job->next_phase(index);
    if (phase.items == 0) {
      ++index;
      continue;
    }
    if (phase.items > 0) {
      auto st = std::make_shared<PhaseState>();
      st->job = std::move(job);
      st->phase = std::move(phase);
      st->index = index;
      state_ = std::move(st);
      busy_.store(true, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    job->finish();
    job.reset();
    index = 0;
    if (!queue_.empty()) {
      job = std::move(queue_.front());
      queue_.pop_front();
    }
  }
  state_.reset();
  busy_.store(false, std::memory_order_relaxed);
}

void ThreadPool::advance(const std::shared_ptr<PhaseState>& done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    publish_locked(done->job, done->index + 1);
  }
  cv_.notify_all();
}

void ThreadPool::run_item(const std::shared_ptr<PhaseState>& st, int item, int id) {
  st->phase.run(item, id);
  if (st->finished.fetch_add(1, std::memory_order_acq_rel) + 1 == st->phase.items) advance(st);
}

bool ThreadPool::run_items(const std::shared_ptr<PhaseState>& st, int id) {
  const Phase& phase = st->phase;
  bool ran = false;
  if (phase.shards == 0) {
    for (int i = st->next.fetch_add(1, std::memory_order_relaxed); i < phase.items;
         i = st->next.fetch_add(1, std::memory_order_relaxed)) {
      run_item(st, i, id);
      ran = true;
    }
    return ran;
  }
  // The shards of this thread's node first, then (their items gone) the others', so that no
  // thread idles while a node with fewer threads still has work.
  const int node = id < int(worker_node_.size()) ? worker_node_[id] : caller_node();
  const int nodes = topology_.nodes();
  for (int own = 1; own >= 0; --own) {
    for (int s = 0; s < phase.shards; ++s) {
      if ((s % nodes == node) != (own == 1)) continue;
      const int first = phase.shard_first[s], count = phase.shard_first[s + 1] - first;
      for (int i = st->shard_next[s].fetch_add(1, std::memory_order_relaxed); i < count;
           i = st->shard_next[s].fetch_add(1, std::memory_order_relaxed)) {
        run_item(st, first + i, id);
        ran = true;
      }
    }
  }
  return ran;
}

void ThreadPool::help_until(const Job& job) {
  note_caller_cpu();
  uint64_t seen = ~uint64_t(0);
  auto last_work = std::chrono::steady_clock::now();
  while (!job.finished()) {
    const uint64_t gen = generation_.load(std::memory_order_acquire);
    if (gen != seen) {
      std::shared_ptr<PhaseState> st;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_acquire);
        st = state_;
      }
      if (st && run_items(st, threads_ - 1)) last_work = std::chrono::steady_clock::now();
      continue;
    }
    // Nothing to claim: the phase's last items run on workers. Spin for the next phase, and past
    // a long tail (a prefill item takes milliseconds) give the core away between checks.
    if (std::chrono::steady_clock::now() - last_work < kPhaseSpin) {
      for (int i = 0; i < 16; ++i) cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

int ThreadPool::default_idle_spin_us() {
  const char* env = std::getenv("HETMOE_IDLE_SPIN_US");
  if (env == nullptr || *env == '\0') return 500;
  char* end = nullptr;
  const long us = std::strtol(env, &end, 10);
  return (end != nullptr && *end == '\0' && us >= 0 && us <= 1000000) ? int(us) : 500;  // bad values: the default
}

void ThreadPool::set_idle_spin_us(int us) { idle_spin_us_.store(std::max(0, us), std::memory_order_relaxed); }

void ThreadPool::worker_main(int id) {
  int avoiding = -2;  // no CPU id: the first job pins the worker
  uint64_t seen = 0;
  auto idle_since = std::chrono::steady_clock::now();
  for (;;) {
    // While a job runs, spin briefly for its next phase; after one, spin idle_spin_us for the next.
    const auto phase_until = std::chrono::steady_clock::now() + kPhaseSpin;
    const auto idle_until = idle_since + std::chrono::microseconds(idle_spin_us_.load(std::memory_order_relaxed));
    while (generation_.load(std::memory_order_acquire) == seen) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= (busy_.load(std::memory_order_relaxed) ? phase_until : idle_until)) break;
      for (int i = 0; i < 16; ++i) cpu_relax();
    }
    std::shared_ptr<PhaseState> st;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
      if (stop_) return;
      seen = generation_.load(std::memory_order_acquire);
      st = state_;
    }
    if (st) {
      // Keep off the caller's CPU: it runs items too, and two of the pool's threads on one core while
      // another idles is the worst case (the scheduler's wake-up placement did that to floating
      // workers: one MoE layer's decode step from DRAM, bf16 3.8 -> 6.3 ms). Pinning workers to
      // fixed CPUs did it too, with the caller, which is the user's thread and not ours to pin.
      // Each worker stays on its node's CPUs (all allowed CPUs on a one-node machine).
      const int caller = caller_cpu_.load(std::memory_order_relaxed);
      const std::vector<int>& mine = topology_.node_cpus[worker_node_[id]];
      if (caller != avoiding) {
        set_affinity(pthread_self(), mine, caller);
        avoiding = caller;
      }
      run_items(st, id);
    }
    // The idle window counts from the last job this worker met, whether it ran items of it or was
    // woken after the caller had finished it alone. Counted from its last job run, long past, such a
    // worker slept again at once and the next job, often microseconds away, paid a futex wake-up and
    // a sleeping thread's scheduling (bench moe's timed call after its idle one, AMX Xeon, int4
    // layer: the submit 11-14 us -> 0.2).
    idle_since = std::chrono::steady_clock::now();
  }
}

}  // namespace hetmoe
