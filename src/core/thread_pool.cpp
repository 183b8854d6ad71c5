#include "thread_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>

KT_NAMESPACE_BEGIN
namespace {

// Waiting threads spin this long before sleeping: back-to-back decode calls then start without a
// futex wake-up, while an idle pool costs no CPU.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

// How a waiting thread spins: pausing (it expects what it waits for from a thread running on another
// CPU), or yielding (that thread may be waiting for this CPU).
enum class Spin { kPause, kYield };

// Spins until ready() or kSpinBeforeSleep has passed (false then).
template <typename Ready>
bool spin_until(Ready ready, Spin spin) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if (spin == Spin::kYield)
      std::this_thread::yield();
    else
      _mm_pause();
    if ((spin == Spin::kYield || (i & 255) == 255) && std::chrono::steady_clock::now() > deadline) return false;
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

// Bumped in every fork() child (pthread_atfork), so a pool can tell it lost its threads without a
// system call per job.
std::atomic<uint64_t> fork_generation{0};

// Several threads of a fork() child may find a pool without workers at once: one respawns it
// while the others wait here. Made anew in every child (a parent's thread may have held it), and
// on first use, never at load (this file has the build's ISA flags).
std::mutex*& respawn_lock() {
  static std::mutex* lock = new std::mutex;
  return lock;
}

uint64_t current_fork_generation() {
  static const int registered = pthread_atfork(nullptr, nullptr, [] {
    fork_generation.fetch_add(1);
    respawn_lock() = new std::mutex;  // the parent's is left as the fork copied it
  });
  (void)registered;
  return fork_generation.load(std::memory_order_acquire);
}

}  // namespace

ThreadPool::ThreadPool(int threads, const std::vector<int>& cpus) : threads_(threads), cpus_(cpus) {
  if (threads < 1) throw std::invalid_argument("a thread pool needs at least one thread");
  for (int cpu : cpus)
    if (cpu < 0) throw std::invalid_argument("CPU ids must be >= 0");
  spawn();
}

ThreadPool::~ThreadPool() {
  if (forked()) {
    (void)workers_.release();  // the parent's threads: nothing to join here (see Workers)
    return;
  }
  stop(*workers_);
}

void ThreadPool::spawn(uint64_t first_ticket) {
  workers_ = std::make_unique<Workers>();
  workers_->submitted = first_ticket;
  workers_->completed = first_ticket;
  spawned_in_fork_generation_.store(current_fork_generation(), std::memory_order_release);
  Workers& w = *workers_;
  w.threads.reserve(threads_);
  std::vector<int> errors(threads_, 0);
  // Workers that spin for the next job: all but one when they would fill every CPU this process may
  // use, so the caller, woken at the end of a call, finds a CPU without waiting for a spinner.
  const int usable = int(cpus_.empty() ? this_thread_cpus().size() : cpus_.size());
  const int spinning = usable > 0 && threads_ >= usable ? std::max(1, usable - 1) : threads_;
  try {
    for (int i = 0; i < threads_; ++i) {
      try {
        w.threads.emplace_back([&w, i, count = threads_, first_ticket, spinning] {
          worker_main(w, i, count, first_ticket, i < spinning);
        });
      } catch (const std::system_error& error) {
        throw std::system_error(error.code(), "cannot start worker thread " + std::to_string(i + 1) + " of " +
                                                  std::to_string(threads_));
      }
    }
    // Each worker pins itself before its first real job, so the memory it first touches (the
    // packed weights) is placed on its node.
    if (!cpus_.empty()) run([&](int worker) { errors[worker] = pin_this_thread(cpus_); });
    for (int error : errors)
      if (error != 0) throw std::system_error(error, std::generic_category(), "cannot pin a worker thread to its CPUs");
  } catch (...) {
    stop(w);
    spawned_in_fork_generation_.store(kNoWorkers, std::memory_order_release);  // the next job tries again
    throw;
  }
}

bool ThreadPool::forked() const {
  return current_fork_generation() != spawned_in_fork_generation_.load(std::memory_order_acquire);
}

bool ThreadPool::all_asleep() {
  if (forked()) respawn_after_fork();
  return workers_->asleep.load(std::memory_order_relaxed) == threads_;
}

void ThreadPool::respawn_after_fork() {
  std::lock_guard<std::mutex> lock(*respawn_lock());
  if (!forked()) return;  // another thread of this child respawned it meanwhile
  // Tickets go on from where the parent's left off, so a ticket of the parent is never a new job's.
  const uint64_t completed = workers_->completed.load(), submitted = workers_->submitted.load();
  if (submitted > completed) lost_from_ = completed, lost_to_ = submitted;
  (void)workers_.release();  // see Workers: left as the fork copied it (or a failed spawn left it)
  spawn(submitted);  // publishes the new workers last (spawned_in_fork_generation_)
}

void ThreadPool::stop(Workers& w) {
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    w.stopping = true;
  }
  w.job_posted.notify_all();
  for (std::thread& thread : w.threads)
    if (thread.joinable()) thread.join();
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

ThreadPool::Ticket ThreadPool::submit(std::function<void(int)> job) {
  if (forked()) respawn_after_fork();
  Workers& w = *workers_;
  Ticket ticket;
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    w.queue.emplace_back(std::move(job));
    ticket = w.submitted.fetch_add(1, std::memory_order_release);
  }
  w.job_posted.notify_all();
  return ticket;
}

void ThreadPool::wait(Ticket ticket) { wait_for(ticket, nullptr, true); }

void ThreadPool::wait(Ticket ticket, const std::atomic<bool>& done) { wait_for(ticket, &done, true); }

void ThreadPool::wait_until_left(Ticket ticket) { wait_for(ticket, nullptr, false); }

void ThreadPool::wait_for(Ticket ticket, const std::atomic<bool>* done, bool lost_throws) {
  auto finished = [&] {
    return workers_->completed.load(std::memory_order_acquire) > ticket ||
           (done != nullptr && done->load(std::memory_order_acquire));
  };
  if (done != nullptr && done->load(std::memory_order_acquire)) return;
  if (!lost_throws) {
    if (forked()) respawn_after_fork();
    if (ticket >= lost_from_ && ticket < lost_to_) return;
  }
  throw_if_lost(ticket);
  // No spinning here: the waiting (Python) thread would take a core from the workers.
  if (finished()) return;
  std::unique_lock<std::mutex> lock(workers_->mutex);
  workers_->job_finished.wait(lock, finished);
}

void ThreadPool::throw_if_lost(Ticket ticket) {
  if (forked()) respawn_after_fork();
  if (ticket >= lost_from_ && ticket < lost_to_)
    throw std::runtime_error("the work in flight when this process forked cannot finish in the child");
}

void ThreadPool::notify_done() {
  Workers& w = *workers_;
  { std::lock_guard<std::mutex> lock(w.mutex); }  // a waiter is either asleep or sees the flag
  w.job_finished.notify_all();
}

void ThreadPool::worker_main(Workers& w, int index, int count, uint64_t first_ticket, bool spins) {
  for (uint64_t next = first_ticket;; ++next) {
    auto ready = [&] { return w.submitted.load(std::memory_order_acquire) > next; };
    if (!(spins ? spin_until(ready, Spin::kPause) : ready())) {
      w.asleep.fetch_add(1, std::memory_order_relaxed);
      std::unique_lock<std::mutex> lock(w.mutex);
      w.job_posted.wait(lock, [&] { return w.stopping || ready(); });
      w.asleep.fetch_sub(1, std::memory_order_relaxed);
    }
    Workers::Job* job;
    {
      std::lock_guard<std::mutex> lock(w.mutex);
      if (w.stopping) return;
      // Not yet completed: this worker has not left it. Deque: pushing and popping others moves nothing.
      job = &w.queue[next - w.completed.load(std::memory_order_relaxed)];
    }
    job->run(index);
    if (job->left.fetch_add(1, std::memory_order_acq_rel) + 1 == count) {
      // Jobs complete in order: a later one whose workers have all left waits for the ones before.
      std::lock_guard<std::mutex> lock(w.mutex);
      uint64_t completed = w.completed.load(std::memory_order_relaxed);
      for (; !w.queue.empty() && w.queue.front().left.load(std::memory_order_acquire) == count; ++completed)
        w.queue.pop_front();
      w.completed.store(completed, std::memory_order_release);
      w.job_finished.notify_all();
    }
  }
}

void wait_for_count(const std::atomic<int>& counter, int target) {
  for (int seen; (seen = counter.load(std::memory_order_acquire)) < target;)
    if (!spin_until([&] { return counter.load(std::memory_order_acquire) != seen; }, Spin::kYield))
      counter.wait(seen, std::memory_order_acquire);
}

KT_NAMESPACE_END
