// A persistent pool of pinned worker threads that runs jobs made of phases of independent items.
//
// A job is a sequence of phases; each phase has a number of items that workers claim with an
// atomic counter, and a phase starts only when every item of the previous one is finished. The
// caller never participates: it submits and later waits, free to drive a GPU meanwhile. Between
// the phases of a job workers spin briefly (phases follow each other within microseconds); once
// no job is running they sleep on a condition variable at once, so an idle pool takes no CPU from
// the caller, which on a small machine needs a core to wake up and use the result.
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

class Job {
 public:
  virtual ~Job() = default;
  // Called by the pool between phases (single-threaded): returns phase `index` (counting from 0),
  // or a Phase with items == -1 when the job is complete.
  virtual Phase next_phase(int index) = 0;

  void wait();
  bool finished() const { return done_.load(std::memory_order_acquire); }

 private:
  friend class ThreadPool;
  void finish();
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()); }
  void submit(std::shared_ptr<Job> job);

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

  void worker_main(int id, int cpu);
  void publish_locked(std::shared_ptr<Job> job, int index);  // under mu_
  void advance(const std::shared_ptr<PhaseState>& done);       // the last item of a phase finished

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
