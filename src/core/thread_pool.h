// A fixed set of worker threads that run one job at a time: job(worker_index) on every worker.
// start() returns at once (that is what makes submit_forward asynchronous); wait() blocks until
// every worker has finished. Inside a job, barrier() separates phases. Optionally every worker
// pins itself to a set of CPUs (a NUMA node's) before it runs anything else.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

KT_NAMESPACE_BEGIN

class ThreadPool {
 public:
  // cpus: the CPUs each worker may run on (empty: no pinning). Throws std::system_error when
  // the kernel refuses the set.
  explicit ThreadPool(int threads, const std::vector<int>& cpus = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()); }
  // The job must not throw: it runs on worker threads and a throw there would abort.
  void start(std::function<void(int)> job);
  void wait();
  void run(std::function<void(int)> job) {
    start(std::move(job));
    wait();
  }
  void barrier();
  // Each worker's allowed CPUs as the kernel reports them, read by the worker itself
  // (sched_getaffinity). Runs a job: not while another one is in flight.
  std::vector<std::vector<int>> worker_cpus();

 private:
  void worker_main(int index);
  void stop();

  std::vector<std::thread> workers_;
  std::function<void(int)> job_;
  std::mutex mutex_;
  std::condition_variable job_posted_, job_finished_;
  std::atomic<uint64_t> generation_{0};  // bumped for every job; workers spin on it, then sleep
  std::atomic<int> unfinished_{0};
  bool stopping_ = false;  // guarded by mutex_
  std::atomic<int> barrier_arrived_{0};
  std::atomic<uint32_t> barrier_round_{0};
};

KT_NAMESPACE_END
