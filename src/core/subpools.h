// The process's worker pools, and one layer split into subpools across them.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "engine.h"
#include "thread_pool.h"

KT_NAMESPACE_BEGIN

// The worker threads of the process (upstream's CPUInfer), shared by every layer: one ThreadPool
// per subpool (threadpool_count), each with its share of the threads, pinned to its CPUs if given.
class WorkerPools {
 public:
  // threads[i] workers for subpool i, pinned to cpus[i] (empty: not pinned).
  WorkerPools(const std::vector<int>& threads, const std::vector<std::vector<int>>& cpus);
  int size() const { return int(pools_.size()); }
  const std::shared_ptr<ThreadPool>& pool(int index) const { return pools_.at(index); }

 private:
  std::vector<std::shared_ptr<ThreadPool>> pools_;
};

// The subpools of one layer (upstream's threadpool_count): one engine per contiguous slice of the
// intermediate dimension, each on its pool of `pools` (pinned to a NUMA node's CPUs if asked). They
// run concurrently; their fp32 partial outputs are summed in subpool order and rounded to bf16
// once, in sync(). One subpool writes bf16 directly.
class MoESubpools {
 public:
  // shape.intermediate is the whole layer's; intermediates[i], subpool i's slice, must add up to it
  // and name one slice per pool. Each engine gets `options` with its share of the inline threshold.
  MoESubpools(MoEShape shape, const FormatTraits& format, const WorkerPools& pools, const std::vector<int>& intermediates,
              const std::vector<int>& skip_experts, const EngineOptions& options = {});
  MoESubpools(const MoESubpools&) = delete;
  MoESubpools& operator=(const MoESubpools&) = delete;

  int size() const { return int(engines_.size()); }
  MoEEngine& engine(int index);  // for loading its slice of the weights
  // Subpools on the same weights and threads for a second call in flight (MoEEngine::twin).
  std::unique_ptr<MoESubpools> twin() const;
  // As MoEEngine::submit / sync, for the whole layer.
  void submit(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights, bf16_t* out);
  void sync();
  bool pending() const { return pending_; }
  void release_scratch();
  // As MoEEngine::set_gpu_experts, for every subpool.
  void set_gpu_experts(const uint8_t* gpu_mask);

 private:
  explicit MoESubpools(int hidden) : hidden_(hidden) {}  // for twin()

  std::mutex api_mutex_;  // as MoEEngine's
  // Declared first so it is destroyed last: an engine's destructor waits for a forward in flight.
  std::vector<AlignedBuffer<float>> partials_;  // per subpool [tokens, hidden], first touched by its threads
  std::vector<std::unique_ptr<MoEEngine>> engines_;
  const int hidden_;
  bf16_t* out_ = nullptr;
  size_t out_count_ = 0;
  bool pending_ = false;
};

KT_NAMESPACE_END
