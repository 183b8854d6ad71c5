#include "stream_calls.h"

#include <pthread.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "bf16.h"
#include "cuda_runtime.h"

KT_NAMESPACE_BEGIN

namespace {

// Every StreamLayer of the process, for the fork handler. Never freed, as the layers themselves.
// Made on first use, never at load: this file has the build's ISA flags, and nothing of it may run
// before the module's CPUID check (a dynamic initializer would run at dlopen).
std::mutex*& registry_mutex() {
  static std::mutex* mutex = new std::mutex;
  return mutex;
}

std::vector<StreamLayer*>& registry() {
  static std::vector<StreamLayer*>* layers = new std::vector<StreamLayer*>;
  return *layers;
}

CudaRuntime::Stream as_stream(uintptr_t handle) { return reinterpret_cast<CudaRuntime::Stream>(handle); }

// As torch's .to(torch.bfloat16), bit for bit: NaN becomes the quiet NaN 0x7FC0 whatever its sign.
bf16_t to_bf16_as_torch(float value) { return std::isnan(value) ? bf16_t(0x7FC0) : float_to_bf16(value); }

}  // namespace

StreamLayer::StreamLayer(MoESubpools* layer, MoESubpools* deferred, int num_experts, int hidden, int top_k)
    : layer_(layer), deferred_(deferred), num_experts_(num_experts), hidden_(hidden), top_k_(top_k) {}

StreamLayer* StreamLayer::create(MoESubpools* layer, MoESubpools* deferred, int num_experts, int hidden,
                                 int top_k) {
  static const int fork_handler = pthread_atfork(nullptr, nullptr, &StreamLayer::after_fork_in_child);
  (void)fork_handler;
  StreamLayer* created = new StreamLayer(layer, deferred, num_experts, hidden, top_k);
  std::lock_guard<std::mutex> lock(*registry_mutex());
  registry().push_back(created);
  return created;
}

void StreamLayer::after_fork_in_child() {
  // Only the forking thread exists here: a lock another thread held is never released.
  registry_mutex() = new std::mutex;
  for (StreamLayer* layer : registry()) {
    layer->engine_mutex_ = new std::mutex;
    layer->state_mutex_ = new std::mutex;
  }
}

void StreamLayer::release(StreamCall* call) {
  std::lock_guard<std::mutex> lock(*state_mutex_);
  if (!call->captured) free_.push_back(call);
}

StreamCall* StreamLayer::submit(uintptr_t stream, int tokens, const StreamInputs& inputs, const StreamSlot& slot,
                                StreamCall* adds) {
  if (tokens < 1) throw std::invalid_argument("a call on a stream needs at least one token");
  if (closed_.load()) throw std::runtime_error("this layer is closed");
  const CudaRuntime& cuda = CudaRuntime::get();
  const bool captured = cuda.capturing(as_stream(stream));
  StreamCall* call;
  {
    std::lock_guard<std::mutex> lock(*state_mutex_);
    if (free_.empty()) calls_.emplace_back(), free_.push_back(&calls_.back());
    call = free_.back();
    free_.pop_back();
  }
  call->owner = this;
  call->tokens = tokens;
  call->slot = slot;
  call->ids_int32 = inputs.ids_int32;
  call->has_deferred = inputs.deferred_ids != nullptr;
  call->captured = false;  // until the host function is queued: a failed call is reused
  call->adds = adds;
  call->gpu_mask = inputs.gpu_mask;  // read when the task starts, at every replay of a graph
  const size_t routes = size_t(tokens) * top_k_;
  try {
    cuda.copy_async(slot.x, inputs.x, size_t(tokens) * hidden_ * sizeof(bf16_t), as_stream(stream));
    cuda.copy_async(slot.ids, inputs.ids, routes * (inputs.ids_int32 ? 4 : 8), as_stream(stream));
    cuda.copy_async(slot.weights, inputs.weights, routes * sizeof(float), as_stream(stream));
    if (call->has_deferred)
      cuda.copy_async(slot.deferred_ids, inputs.deferred_ids, routes * sizeof(int64_t), as_stream(stream));
    call->captured = captured;
    cuda.launch_host_func(as_stream(stream), &StreamLayer::on_submit, call);
  } catch (...) {
    // Copies already queued only write the slot, which the caller gives back.
    call->captured = false;
    release(call);
    throw;
  }
  count_queued(captured);
  return call;
}

void StreamLayer::count_queued(bool captured) {
  std::lock_guard<std::mutex> lock(*state_mutex_);
  if (!captured) ++queued_;
}

void StreamLayer::count_completed(bool captured) {
  std::lock_guard<std::mutex> lock(*state_mutex_);
  if (!captured) ++completed_;
}

void StreamLayer::drop_deferred(StreamCall* call, uintptr_t stream) {
  if (!call || call->owner != this || !call->has_deferred)
    throw std::invalid_argument("drop_deferred of a call without deferred experts of this layer");
  const CudaRuntime& cuda = CudaRuntime::get();
  const bool captured = cuda.capturing(as_stream(stream));
  cuda.launch_host_func(as_stream(stream), &StreamLayer::on_drop, call);
  count_queued(captured);
}

void StreamLayer::on_drop(void* data) {
  StreamCall& call = *static_cast<StreamCall*>(data);
  // Captured: a replay queues this again; the record stays (captured records are never reused).
  const bool captured = call.captured;
  StreamLayer& layer = *call.owner;
  layer.collect_deferred(call, nullptr);
  layer.count_completed(captured);
}

void StreamLayer::sync(StreamCall* call, uintptr_t stream, void* device_out) {
  if (!call || call->owner != this) throw std::invalid_argument("sync of a call this layer did not submit");
  const CudaRuntime& cuda = CudaRuntime::get();
  cuda.launch_host_func(as_stream(stream), &StreamLayer::on_sync, call);
  cuda.copy_async(device_out, call->slot.out, size_t(call->tokens) * hidden_ * sizeof(bf16_t), as_stream(stream));
}

void StreamLayer::on_submit(void* data) {
  StreamCall& call = *static_cast<StreamCall*>(data);
  call.owner->start(call);
}

void StreamLayer::on_sync(void* data) {
  StreamCall& call = *static_cast<StreamCall*>(data);
  call.owner->finish(call);
}

void StreamLayer::start(StreamCall& call) {
  std::lock_guard<std::mutex> lock(*engine_mutex_);
  call.deferred_done = false;
  if (closed_.load()) return;
  try {
    const int64_t* ids = static_cast<const int64_t*>(call.slot.ids);
    if (call.ids_int32) {
      const size_t routes = size_t(call.tokens) * top_k_;
      call.wide_ids.resize(routes);
      const int32_t* narrow = static_cast<const int32_t*>(call.slot.ids);
      for (size_t i = 0; i < routes; ++i) call.wide_ids[i] = narrow[i];
      ids = call.wide_ids.data();
    }
    const bf16_t* x = static_cast<const bf16_t*>(call.slot.x);
    const float* weights = static_cast<const float*>(call.slot.weights);
    if (call.gpu_mask) {  // one copy, so that the engines see one mask whatever the caller does meanwhile
      call.mask_now.assign(call.gpu_mask, call.gpu_mask + num_experts_);
      layer_->set_gpu_experts(call.mask_now.data());
    }
    layer_->submit(x, call.tokens, ids, weights, call.slot.out);
    running_ = &call;
    if (call.has_deferred) {  // queued behind the call above on the same threads, as on the CPU path
      finish_deferred_locked();  // a call of this layer before, not yet added (a one-layer stack)
      deferred_->submit(x, call.tokens, static_cast<const int64_t*>(call.slot.deferred_ids), weights,
                        call.slot.deferred_out);
      deferred_running_ = &call;
    }
  } catch (...) {
    keep_error(std::current_exception());
  }
}

void StreamLayer::finish(StreamCall& call) {
  bool ok = false, closed;
  {
    std::lock_guard<std::mutex> lock(*engine_mutex_);
    closed = closed_.load();
    if (!closed && running_ == &call) {
      running_ = nullptr;
      try {
        layer_->sync();
        ok = true;
      } catch (...) {
        keep_error(std::current_exception());
      }
    }
  }
  // Outside this layer's lock: the layer before takes its own (one engine lock at a time).
  if (call.adds && !call.adds->owner->collect_deferred(*call.adds, ok ? call.slot.out : nullptr) && ok) {
    ok = false;
    keep_error(std::make_exception_ptr(
        std::runtime_error("the deferred experts this call adds (of the layer before) did not run; see that "
                           "layer's error")));
  }
  // Never a silent wrong result on the GPU: NaN, and the error at the next sync (a closed layer's
  // call has no result: NaN, never the slot's last output; close() warned).
  if (!ok) {
    const size_t values = size_t(call.tokens) * hidden_;
    for (size_t i = 0; i < values; ++i) call.slot.out[i] = 0x7FC0;
  }
  const bool captured = call.captured;
  if (!call.has_deferred) release(&call);  // else its consumer releases it (collect_deferred, on_drop)
  count_completed(captured);
}

void StreamLayer::finish_deferred_locked() {
  StreamCall* call = deferred_running_;
  if (!call) return;
  deferred_running_ = nullptr;
  try {
    deferred_->sync();
    call->deferred_done = true;
  } catch (...) {
    keep_error(std::current_exception());
  }
}

bool StreamLayer::collect_deferred(StreamCall& call, bf16_t* out) {
  bool ok;
  {
    std::lock_guard<std::mutex> lock(*engine_mutex_);
    if (!closed_.load() && deferred_running_ == &call) finish_deferred_locked();
    ok = call.deferred_done;
    call.deferred_done = false;
  }
  if (ok && out) {  // (out + deferred) in fp32, rounded once, as the CPU path's sync_forward
    const bf16_t* add = call.slot.deferred_out;
    const size_t values = size_t(call.tokens) * hidden_;
    for (size_t i = 0; i < values; ++i) out[i] = to_bf16_as_torch(bf16_to_float(out[i]) + bf16_to_float(add[i]));
  }
  release(&call);
  return ok;
}

void StreamLayer::keep_error(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(*state_mutex_);
  if (!error_) error_ = error;
}

void StreamLayer::rethrow_error() {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(*state_mutex_);
    error.swap(error_);
  }
  if (error) std::rethrow_exception(error);
}

uint64_t StreamLayer::outstanding() {
  std::lock_guard<std::mutex> lock(*state_mutex_);
  return queued_ - completed_;
}

uint64_t StreamLayer::queued() {
  std::lock_guard<std::mutex> lock(*state_mutex_);
  return queued_;
}

uint64_t StreamLayer::completed() {
  std::lock_guard<std::mutex> lock(*state_mutex_);
  return completed_;
}

void StreamLayer::close() {
  std::lock_guard<std::mutex> lock(*engine_mutex_);
  if (closed_.load()) return;
  // The engines go with the wrapper: tasks they run finish first (a task lost at a fork throws).
  for (auto [engine, running] : {std::pair{layer_, &running_}, std::pair{deferred_, &deferred_running_}}) {
    if (*running) {
      *running = nullptr;
      try {
        engine->sync();
      } catch (...) {
      }
    }
  }
  closed_.store(true);
  layer_ = deferred_ = nullptr;
}

namespace {

// Every fence of the process: never freed (a byte each; fences are queued at close and buffer
// clearing, not per call), so a host function never writes freed memory.
std::mutex& fences_mutex() {
  static std::mutex* mutex = new std::mutex;
  return *mutex;
}

std::deque<std::atomic<bool>>& fences() {
  static auto* all = new std::deque<std::atomic<bool>>;
  return *all;
}

void on_fence(void* flag) { static_cast<std::atomic<bool>*>(flag)->store(true); }

}  // namespace

uint64_t queue_fence(uintptr_t stream) {
  const CudaRuntime& cuda = CudaRuntime::get();
  if (cuda.capturing(as_stream(stream))) return 0;
  std::atomic<bool>* flag;
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(fences_mutex());
    flag = &fences().emplace_back(false);
    id = fences().size();
  }
  cuda.launch_host_func(as_stream(stream), &on_fence, flag);
  return id;
}

bool fence_passed(uint64_t fence) {
  std::lock_guard<std::mutex> lock(fences_mutex());
  if (fence == 0 || fence > fences().size()) throw std::invalid_argument("not a fence");
  return fences()[fence - 1].load();
}

KT_NAMESPACE_END
