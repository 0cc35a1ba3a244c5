// A persistent pool of worker threads that runs jobs made of phases of independent items.
//
// A job is a sequence of phases; each phase has a number of items that workers claim with an
// atomic counter, and a phase starts only when every item of the previous one is finished.
//
// A pool of N threads is N - 1 workers plus whoever waits: submit() returns at once (the
// caller is free to drive a GPU or run Python meanwhile, while the workers start), and wait()
// runs items of the published phases on the waiting thread until its job is done. The caller is
// the N-th participant because it is runnable anyway: with N workers on N cores it would wait on
// a futex and, on wake-up, compete for a core with a worker; and a sleeping waiter costs a wake-up
// at the end of every job (measured: one decode step of a 4-layer model, 21 jobs, 18.2 -> 14.4 ms).
// Workers keep off the CPU the caller last ran on (their affinity is every other CPU of their
// node, updated when the caller moves), so the caller and the workers never share a core.
// Between the phases of a job workers spin briefly (phases follow each other within microseconds);
// once no job is running they spin idle_spin_us() more (counted from their last job, or from their
// wake-up where the job was done before they got to it), then sleep on a condition variable, so an
// idle pool takes no CPU.
//
// On a NUMA machine (numa.h) the pool's threads are split into one group per node, in proportion
// to the nodes' CPUs, each worker kept to its node's CPUs. A phase may say which of its items read
// which node's memory (its shards, numa_split.h): threads claim their own node's items first and
// help with the others' only once those are gone, so weights placed on a node are streamed by that
// node's cores and no thread idles while another node has work left.
#pragma once
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "numa.h"

namespace hetmoe {

// The pause of a spin loop (it leaves the core's resources to its sibling hyperthread meanwhile).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until ready() holds, for an item that reads what an item claimed before it in the same phase
// writes (items are claimed in order, so that one is running, or done, and never waits on this one);
// after 4096 pauses (tens to hundreds of microseconds, by the CPU's pause) it gives the core away
// between checks, as the writer's thread may not be running (more pool threads than CPUs).
template <class Ready>
void spin_until(Ready ready) {
  for (int pauses = 0; !ready();) {
    if (pauses < 4096) {
      cpu_relax();
      ++pauses;
    } else {
      std::this_thread::yield();
    }
  }
}

struct Phase {
  int items = -1;  // -1: the job has no more phases; 0: this phase is empty and skipped
  std::function<void(int item, int worker)> run;
  // 0: any thread takes any item. Otherwise items [shard_first[s], shard_first[s + 1]) belong to
  // shard s, whose memory is on the pool's node s (modulo the pool's node count: an engine split
  // for another pool still runs); shard_first[shards] == items.
  int shards = 0;
  std::array<int, kMaxNodes + 1> shard_first{};
};

class ThreadPool;

class Job {
 public:
  virtual ~Job() = default;
  // Called by the pool between phases (single-threaded): returns phase `index` (counting from 0),
  // or a Phase with items == -1 when the job is complete.
  virtual Phase next_phase(int index) = 0;

  // Blocks until the job is done, running items of the pool's phases meanwhile.
  void wait();
  bool finished() const { return done_.load(std::memory_order_acquire); }

 private:
  friend class ThreadPool;
  void finish();
  std::weak_ptr<ThreadPool> pool_;  // set by submit; expired once the pool is gone (it drains first)
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// A job of one phase: fn(item) for items [0, n). For small parallel loops outside the engines.
class ForJob final : public Job {
 public:
  ForJob(int n, std::function<void(int)> fn) : n_(n), fn_(std::move(fn)) {}
  Phase next_phase(int index) override {
    if (index > 0) return {};
    return {n_, [this](int i, int) { fn_(i); }};
  }

 private:
  int n_;
  std::function<void(int)> fn_;
};

class ThreadPool : public std::enable_shared_from_this<ThreadPool> {
 public:
  // `threads` participants: threads - 1 workers and the waiting caller, spread over the topology's
  // nodes in proportion to their CPUs. Create with make_shared (jobs keep a weak reference).
  explicit ThreadPool(int threads, NumaTopology topology = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }
  const NumaTopology& topology() const { return topology_; }
  void submit(std::shared_ptr<Job> job);
  // Runs items of whatever phase is published until `job` is finished (Job::wait calls this).
  void help_until(const Job& job);
  // Microseconds workers spin after a job for the next one before they sleep (0: at once).
  // Default 500, or HETMOE_IDLE_SPIN_US: a decode step issues its next job within a few hundred
  // microseconds of Python, and a worker already awake saves its wake-up (measured in one process,
  // alternating: a 4-layer model's decode step 13.9-14.1 ms with 0, 13.35 ms with 500). The spin
  // happens off the caller's CPU and stops half a millisecond after the last job.
  static void set_idle_spin_us(int us);
  static int idle_spin_us() { return idle_spin_us_.load(std::memory_order_relaxed); }

 private:
  // One published phase: immutable but for its counters, so a worker that still holds the
  // previous phase can only find it exhausted, never claim items of the next one by mistake.
  struct PhaseState {
    std::shared_ptr<Job> job;
    Phase phase;
    int index = 0;
    std::atomic<int> next{0};
    std::atomic<int> finished{0};
    std::array<std::atomic<int>, kMaxNodes> shard_next{};  // per shard, for sharded phases
  };

  void worker_main(int id);
  void note_caller_cpu();  // records the CPU the calling thread runs on
  // Claims and runs items of `st` until none is left; true if this thread ran any.
  bool run_items(const std::shared_ptr<PhaseState>& st, int id);
  void run_item(const std::shared_ptr<PhaseState>& st, int item, int id);
  int caller_node() const;  // the node of the CPU the calling thread is on
  void drain();  // runs every submitted job to completion on this thread's behalf
  void publish_locked(std::shared_ptr<Job> job, int index);  // under mu_
  void advance(const std::shared_ptr<PhaseState>& done);       // the last item of a phase finished

  int threads_;
  NumaTopology topology_;
  std::vector<int> worker_node_;        // node of each worker; the caller's is where it runs
  std::vector<int> cpu_node_;           // node of each CPU id (-1: not allowed)
  std::atomic<int> caller_cpu_{-1};     // where the submitting / waiting thread last ran
  static int default_idle_spin_us();
  static inline std::atomic<int> idle_spin_us_{default_idle_spin_us()};
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::shared_ptr<PhaseState> state_;    // guarded by mu_
  std::atomic<uint64_t> generation_{0};  // bumped each time a new phase is published
  std::atomic<bool> busy_{false};        // a job is in progress (its next phase is imminent)
};

}  // namespace hetmoe
