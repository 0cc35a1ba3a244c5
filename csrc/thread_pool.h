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
// Workers keep off the CPU the caller last ran on (their affinity is every other allowed CPU,
// updated when the caller moves), so the caller and the workers never share a core.
// Between the phases of a job workers spin briefly (phases follow each other within microseconds);
// once no job is running they sleep on a condition variable at once, so an idle pool takes no CPU.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace hetmoe {

struct Phase {
  int items = -1;  // -1: the job has no more phases; 0: this phase is empty and skipped
  std::function<void(int item, int worker)> run;
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
  // `threads` participants: threads - 1 workers and the waiting caller. Create with make_shared
  // (jobs keep a weak reference to their pool).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }
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
  };

  void worker_main(int id);
  void note_caller_cpu();  // records the CPU the calling thread runs on
  // Claims and runs items of `st` until none is left; true if this thread ran any.
  bool run_items(const std::shared_ptr<PhaseState>& st, int id);
  void drain();  // runs every submitted job to completion on this thread's behalf
  void publish_locked(std::shared_ptr<Job> job, int index);  // under mu_
  void advance(const std::shared_ptr<PhaseState>& done);       // the last item of a phase finished

  int threads_;
  std::vector<int> cpus_;               // the CPUs this process may run on
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
