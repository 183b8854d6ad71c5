// A fixed set of worker threads that run jobs one after another, in the order they were submitted:
// a job is job(worker_index) on every worker, and it has finished once every worker has left it.
// Each worker goes on to the next job as soon as it leaves one, so one the OS runs late holds up no
// other's next job. submit() returns at once with a ticket (that is what makes submit_forward
// asynchronous, and lets several layers be in flight on one pool); wait(ticket) blocks until that
// job has finished. A job that hands out its work item by item may be complete before every worker
// has been through it (a worker the OS ran late finds nothing left): it sets a flag of its own and
// wait(ticket, flag) returns then. Optionally every worker pins itself to a set of CPUs (a NUMA
// node's) before it runs anything else.
//
// After fork() the child has none of the workers: the pool starts new ones on its next job. Jobs
// that were queued or running at the fork cannot finish in the child; waiting for one throws.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

KT_NAMESPACE_BEGIN

class ThreadPool {
 public:
  // cpus: the CPUs each worker may run on (empty: no pinning). Throws std::system_error when a
  // thread cannot be started or the kernel refuses the CPU set; nothing is left running then.
  explicit ThreadPool(int threads, const std::vector<int>& cpus = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  using Ticket = uint64_t;

  int size() const { return threads_; }
  // Whether every worker was asleep waiting for a job just now: the next job then starts only after
  // a wake-up, which costs tens of microseconds or more on a busy or virtual machine.
  bool all_asleep();
  // Queues a job behind every job submitted before it. The job must not throw: it runs on worker
  // threads and a throw there would abort.
  Ticket submit(std::function<void(int)> job);
  // Blocks until job `ticket` has finished (and so every job before it). Throws for a job lost at
  // a fork (see above).
  void wait(Ticket ticket);
  // Blocks until job `ticket` has finished or `done` is true; the job calls notify_done() after
  // setting it. Workers may still be inside the job when this returns.
  void wait(Ticket ticket, const std::atomic<bool>& done);
  void notify_done();
  // Blocks until no worker is inside job `ticket` any more; a job lost at a fork has none.
  void wait_until_left(Ticket ticket);
  // Throws as wait() does when job `ticket` was lost at a fork (its work can never finish here).
  void throw_if_lost(Ticket ticket);
  void run(std::function<void(int)> job) { wait(submit(std::move(job))); }
  // Each worker's allowed CPUs as the kernel reports them, read by the worker itself
  // (sched_getaffinity). Runs a job: not while another one is in flight.
  std::vector<std::vector<int>> worker_cpus();

 private:
  // The threads and everything they synchronize on. Replaced whole in a forked child, where the
  // parent's copy is left alone: its threads do not exist there, and destroying a condition
  // variable they waited on would block forever.
  struct Workers {
    std::vector<std::thread> threads;
    std::mutex mutex;
    std::condition_variable job_posted, job_finished;
    struct Job {
      explicit Job(std::function<void(int)> run) : run(std::move(run)) {}
      std::function<void(int)> run;
      std::atomic<int> left{0};  // workers that have been through it
    };
    std::deque<Job> queue;  // jobs completed .. submitted - 1; guarded by mutex
    // Jobs submitted, and completed (every worker has left them) so far. A worker starts job n once
    // it has left job n - 1 and n < submitted (spinning a while, then sleeping): a worker the OS runs
    // late holds up no other worker's next job.
    std::atomic<uint64_t> submitted{0}, completed{0};
    std::atomic<int> asleep{0};  // workers waiting for a job in job_posted rather than spinning
    bool stopping = false;  // guarded by mutex
  };

  // New Workers with threads_ running threads, pinned to cpus_, numbering jobs from `first_ticket`.
  void spawn(uint64_t first_ticket = 0);
  bool forked() const;   // the workers are not this process's (a fork() child, or a failed spawn)
  void respawn_after_fork();
  // wait() and its variants: `done` may be null; lost_throws: a job lost at a fork is an error.
  void wait_for(Ticket ticket, const std::atomic<bool>* done, bool lost_throws);
  static void stop(Workers& workers);
  static void worker_main(Workers& workers, int index, int count, uint64_t first_ticket, bool spins);

  static constexpr uint64_t kNoWorkers = ~uint64_t(0);  // a failed spawn: never a fork generation

  const int threads_;
  const std::vector<int> cpus_;
  std::atomic<uint64_t> spawned_in_fork_generation_{0};
  // Tickets [lost_from_, lost_to_): jobs queued or running when the process forked, lost here.
  uint64_t lost_from_ = 0, lost_to_ = 0;
  std::unique_ptr<Workers> workers_;
};

// Blocks until counter >= target: spins a while (what it waits for is usually short), yielding the CPU
// to any thread waiting for it (maybe the one the counter waits for), then sleeps in
// std::atomic::wait. Whoever makes the counter reach target calls counter.notify_all().
void wait_for_count(const std::atomic<int>& counter, int target);

KT_NAMESPACE_END
