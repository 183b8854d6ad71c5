#include "subpools.h"

#include <algorithm>
#include <cstring>

#include "bf16.h"

KT_NAMESPACE_BEGIN
namespace {

// Up to this many outputs the subpools' partials are summed on the calling thread (tens of
// microseconds); above, every subpool's threads sum a share.
constexpr size_t kInlineReduceValues = size_t(1) << 16;
// A share is a multiple of 32 outputs: 64 bytes of bf16, so no two threads write one cache line.
constexpr size_t kReduceUnit = 32;

// out[i] = bf16(sum_p parts[p][i]) for i in [begin, end), summed in fp32 in the order given.
void sum_to_bf16(const std::vector<AlignedBuffer<float>>& parts, size_t begin, size_t end, bf16_t* out) {
  // In chunks, so the running sum stays in L1 while each part streams through once.
  constexpr size_t kChunk = 1024;
  float sum[kChunk];
  for (size_t first = begin; first < end; first += kChunk) {
    const size_t n = std::min(kChunk, end - first);
    std::memcpy(sum, parts[0].data() + first, n * sizeof(float));
    for (size_t p = 1; p < parts.size(); ++p) {
      const float* part = parts[p].data() + first;
      for (size_t i = 0; i < n; ++i) sum[i] += part[i];
    }
    for (size_t i = 0; i < n; ++i) out[first + i] = float_to_bf16(sum[i]);
  }
}

}  // namespace

WorkerPools::WorkerPools(const std::vector<int>& threads, const std::vector<std::vector<int>>& cpus) {
  require(!threads.empty() && threads.size() == cpus.size(), "threads and cpus need one entry per subpool");
  for (size_t i = 0; i < threads.size(); ++i) {
    require(threads[i] >= 1, "every subpool needs a thread");
    pools_.push_back(std::make_shared<ThreadPool>(threads[i], cpus[i]));
  }
}

MoESubpools::MoESubpools(MoEShape shape, const FormatTraits& format, const WorkerPools& pools,
                         const std::vector<int>& intermediates, const std::vector<int>& skip_experts,
                         const EngineOptions& common)
    : partials_(intermediates.size()), hidden_(shape.hidden) {
  require(int(intermediates.size()) == pools.size(), "one intermediate slice per subpool of the worker pools");
  int total = 0;
  for (int intermediate : intermediates) total += intermediate;
  require(total == shape.intermediate, "the subpools' slices must add up to moe_intermediate_size");
  for (int i = 0; i < pools.size(); ++i) {
    MoEShape slice = shape;
    slice.intermediate = intermediates[i];
    // Each gets its share of the inline threshold: the whole layer's work decides, for all alike.
    EngineOptions options = common;
    options.inline_multiply_adds = common.inline_multiply_adds * intermediates[i] / shape.intermediate;
    engines_.push_back(std::make_unique<MoEEngine>(slice, format, pools.pool(i), skip_experts, options));
  }
}

std::unique_ptr<MoESubpools> MoESubpools::twin() const {
  std::unique_ptr<MoESubpools> twin(new MoESubpools(hidden_));
  twin->partials_.resize(engines_.size());
  for (const std::unique_ptr<MoEEngine>& engine : engines_) twin->engines_.push_back(engine->twin());
  return twin;
}

MoEEngine& MoESubpools::engine(int index) {
  if (index < 0 || index >= size()) throw std::out_of_range("no such subpool");
  return *engines_[index];
}

void MoESubpools::submit(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights,
                         bf16_t* out) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("a forward is already submitted; call sync first");
  if (size() == 1) {
    engines_[0]->submit(hidden, tokens, ids, weights, out);
  } else {
    const size_t count = size_t(std::max(tokens, 0)) * hidden_;
    for (AlignedBuffer<float>& partial : partials_) partial.reserve(count);
    int started = 0;
    try {
      for (; started < size(); ++started)
        engines_[started]->submit(hidden, tokens, ids, weights, partials_[started].data());
    } catch (...) {
      for (int i = 0; i < started; ++i) engines_[i]->sync();
      throw;
    }
    out_count_ = count;
  }
  out_ = out;
  pending_ = true;
}

void MoESubpools::sync() {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (!pending_) throw std::logic_error("sync without a submitted forward");
  pending_ = false;
  std::exception_ptr failure;
  for (std::unique_ptr<MoEEngine>& engine : engines_) {
    try {
      engine->sync();  // every engine, even after one failed: none may be left in flight
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  if (size() == 1) return;
  if (out_count_ <= kInlineReduceValues) return sum_to_bf16(partials_, 0, out_count_, out_);
  // Global worker g of `workers` (all subpools' threads, just back from the forward and still
  // spinning, so waking them is cheap) sums units [g * units / workers, (g + 1) * units / workers).
  int workers = 0;
  for (std::unique_ptr<MoEEngine>& engine : engines_) workers += engine->pool().size();
  const size_t units = (out_count_ + kReduceUnit - 1) / kReduceUnit;
  int first_worker = 0;
  std::vector<ThreadPool::Ticket> tickets;
  for (std::unique_ptr<MoEEngine>& engine : engines_) {
    tickets.push_back(engine->pool().submit([this, first_worker, workers, units](int worker) {
      const size_t g = size_t(first_worker + worker);
      const size_t begin = g * units / workers * kReduceUnit, end = (g + 1) * units / workers * kReduceUnit;
      sum_to_bf16(partials_, begin, std::min(end, out_count_), out_);
    }));
    first_worker += engine->pool().size();
  }
  for (int i = 0; i < size(); ++i) engines_[i]->pool().wait(tickets[i]);
}

void MoESubpools::set_gpu_experts(const uint8_t* gpu_mask) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot change the GPU experts while a forward is in flight");
  for (std::unique_ptr<MoEEngine>& engine : engines_) engine->set_gpu_experts(gpu_mask);
}

void MoESubpools::release_scratch() {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot release buffers while a forward is in flight");
  for (std::unique_ptr<MoEEngine>& engine : engines_) engine->release_scratch();
  for (AlignedBuffer<float>& partial : partials_) partial.release();
}

KT_NAMESPACE_END
