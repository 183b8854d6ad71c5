#include "thread_pool.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <system_error>

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

// A CPU mask sized for `cpus` CPUs (CPU_ALLOC): the fixed cpu_set_t stops at 1024 CPUs.
class CpuMask {
 public:
  explicit CpuMask(int cpus) : bytes_(CPU_ALLOC_SIZE(cpus)), set_(CPU_ALLOC(cpus)) {
    if (set_) CPU_ZERO_S(bytes_, set_.get());
  }
  bool ok() const { return set_ != nullptr; }
  size_t bytes() const { return bytes_; }
  cpu_set_t* get() { return set_.get(); }

 private:
  struct Free {
    void operator()(cpu_set_t* set) const { CPU_FREE(set); }
  };
  size_t bytes_;
  std::unique_ptr<cpu_set_t, Free> set_;
};

// Restricts the calling thread to `cpus`; returns 0 or an errno value. Never throws (runs as a job).
int pin_this_thread(const std::vector<int>& cpus) {
  CpuMask mask(*std::max_element(cpus.begin(), cpus.end()) + 1);
  if (!mask.ok()) return ENOMEM;
  for (int cpu : cpus) CPU_SET_S(cpu, mask.bytes(), mask.get());
  return sched_setaffinity(0, mask.bytes(), mask.get()) == 0 ? 0 : errno;
}

// The CPUs the calling thread may run on; the mask grows until it covers the kernel's CPU count.
std::vector<int> this_thread_cpus() {
  for (int count = 1024; count <= (1 << 20); count *= 2) {
    CpuMask mask(count);
    if (!mask.ok()) return {};
    if (sched_getaffinity(0, mask.bytes(), mask.get()) != 0) {
      if (errno == EINVAL) continue;
      return {};
    }
    std::vector<int> cpus;
    for (int cpu = 0; cpu < count; ++cpu)
      if (CPU_ISSET_S(cpu, mask.bytes(), mask.get())) cpus.push_back(cpu);
    return cpus;
  }
  return {};
}

}  // namespace

ThreadPool::ThreadPool(int threads, const std::vector<int>& cpus) {
  for (int cpu : cpus)
    if (cpu < 0) throw std::invalid_argument("CPU ids must be >= 0");
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this, i] { worker_main(i); });
  if (cpus.empty()) return;
  // Each worker pins itself before its first real job, so the memory it first touches (the packed
  // weights) is placed on its node.
  std::vector<int> errors(threads, 0);
  run([&](int worker) { errors[worker] = pin_this_thread(cpus); });
  for (int error : errors)
    if (error != 0) {
      stop();  // the destructor does not run for a half-built object
      throw std::system_error(error, std::generic_category(), "cannot pin a worker thread to its CPUs");
    }
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    generation_.fetch_add(1);
  }
  job_posted_.notify_all();
  for (std::thread& worker : workers_)
    if (worker.joinable()) worker.join();
}

std::vector<std::vector<int>> ThreadPool::worker_cpus() {
  std::vector<std::vector<int>> cpus(size());
  run([&](int worker) {
    try {
      cpus[worker] = this_thread_cpus();
    } catch (...) {  // out of memory: report nothing rather than abort in a worker
    }
  });
  return cpus;
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
