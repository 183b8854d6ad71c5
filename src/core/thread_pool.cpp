#include "thread_pool.h"

#include <immintrin.h>

#include <chrono>

KT_NAMESPACE_BEGIN
namespace {

// Waiting threads spin this long before sleeping: back-to-back decode calls then start without a
// futex wake-up, while an idle pool costs no CPU.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

template <typename Ready>
bool spin_until(Ready ready) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    _mm_pause();
    if ((i & 255) == 255 && std::chrono::steady_clock::now() > deadline) return false;
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    generation_.fetch_add(1);
  }
  job_posted_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::start(std::function<void(int)> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = std::move(job);
    unfinished_.store(size());
    generation_.fetch_add(1, std::memory_order_release);
  }
  job_posted_.notify_all();
}

void ThreadPool::wait() {
  // No spinning here: the waiting (Python) thread would take a core from the workers.
  std::unique_lock<std::mutex> lock(mutex_);
  job_finished_.wait(lock, [this] { return unfinished_.load(std::memory_order_acquire) == 0; });
}

void ThreadPool::barrier() {
  const uint32_t round = barrier_round_.load(std::memory_order_acquire);
  if (barrier_arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size()) {
    barrier_arrived_.store(0, std::memory_order_relaxed);
    barrier_round_.fetch_add(1, std::memory_order_release);
    return;
  }
  while (barrier_round_.load(std::memory_order_acquire) == round) {
    if (!spin_until([&] { return barrier_round_.load(std::memory_order_acquire) != round; }))
      std::this_thread::yield();  // more threads than cores: let the others reach the barrier
  }
}

void ThreadPool::worker_main(int index) {
  uint64_t seen = 0;
  for (;;) {
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      job_posted_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      seen = generation_.load(std::memory_order_acquire);
    }
    job_(index);  // start() replaces job_ only after wait(), i.e. when no worker is inside it
    if (unfinished_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      job_finished_.notify_all();
    }
  }
}

KT_NAMESPACE_END
