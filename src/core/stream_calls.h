// Forwards ordered on a caller's CUDA stream (SGLang's path): the inputs are copied into host
// buffers on the stream, a host function on the stream starts the CPU task, and at sync a host
// function waits for it before the output is copied back on the stream. Nothing here calls the
// CUDA runtime from a host function (CUDA forbids it), and nothing here needs Python's GIL.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "subpools.h"

KT_NAMESPACE_BEGIN

// The host buffers of one call, owned by the caller (pinned where the CUDA runtime is real): bf16
// [tokens, hidden] for x, out and deferred_out; ids (int64, or int32 when the caller's are) and
// float32 weights [tokens, top_k]; int64 deferred_ids [tokens, top_k] only with deferred experts.
struct StreamSlot {
  void* x = nullptr;
  void* ids = nullptr;
  void* weights = nullptr;
  void* deferred_ids = nullptr;
  bf16_t* out = nullptr;
  bf16_t* deferred_out = nullptr;
};

// The caller's inputs of one call: addresses of contiguous tensors on the stream's device (or on
// the host), with the slot's dtypes.
struct StreamInputs {
  const void* x = nullptr;
  const void* ids = nullptr;
  const void* weights = nullptr;
  const void* deferred_ids = nullptr;
  bool ids_int32 = false;
  // The caller's live mask, num_experts bytes, read each time the task starts (a CUDA graph replays
  // with the mask of that moment, as upstream's): the caller keeps this memory alive. Null: keep the set.
  const uint8_t* gpu_mask = nullptr;
};

class StreamLayer;

// One call on a stream: what its two host functions need. Records are reused once both have run,
// except those captured into a CUDA graph, which every replay runs again.
struct StreamCall {
  StreamLayer* owner = nullptr;
  int tokens = 0;
  StreamSlot slot;
  bool ids_int32 = false;
  bool has_deferred = false;
  bool captured = false;
  StreamCall* adds = nullptr;     // the call (of the layer before) whose deferred output this call adds
  bool deferred_done = false;     // its deferred task finished (collected early when a call of the same layer starts)
  std::vector<int64_t> wide_ids;  // int32 ids widened for the engine
  const uint8_t* gpu_mask = nullptr;  // the caller's live mask (StreamInputs::gpu_mask)
  std::vector<uint8_t> mask_now;      // what it held when the task started
};

// The stream path of one layer (a KTMoEWrapper): its engines and the calls queued on streams.
class StreamLayer {
 public:
  // A host function may run after its wrapper is closed, at any later time (a held stream, a CUDA
  // graph replayed): a StreamLayer is never destroyed, and after close() its host functions only
  // do their bookkeeping.
  static StreamLayer* create(MoESubpools* layer, MoESubpools* deferred, int num_experts, int hidden, int top_k);

  // Queues on `stream` the copies of the inputs into `slot` and the host function that starts the CPU
  // task (and the deferred experts' task); `adds`: a call of the layer before whose deferred output
  // this call adds at sync (or null). Returns the call, for sync().
  StreamCall* submit(uintptr_t stream, int tokens, const StreamInputs& inputs, const StreamSlot& slot,
                     StreamCall* adds);
  // Queues on `stream` the host function that waits for `call` (and adds its `adds`), then the copy
  // of its output to `device_out`. Where the CPU task failed, the output is NaN and the error is
  // kept for rethrow_error().
  void sync(StreamCall* call, uintptr_t stream, void* device_out);
  // `call` submitted with deferred experts that no later call adds (flush_deferred dropped them):
  // queues on `stream` the host function that waits for them and frees the call's record.
  void drop_deferred(StreamCall* call, uintptr_t stream);
  // Rethrows (once) the first error a host function met, if any.
  void rethrow_error();
  // Calls (and dropped deferrals) queued outside a CUDA graph whose last host function has not run yet.
  uint64_t outstanding();
  // Calls queued outside a CUDA graph so far, and of them those whose sync host function has run
  // (they finish in order): the call that made queued() n is done once completed() >= n.
  uint64_t queued();
  uint64_t completed();
  // Waits for a CPU task in flight (never for the stream), then makes later host functions do nothing.
  void close();

 private:
  StreamLayer(MoESubpools* layer, MoESubpools* deferred, int num_experts, int hidden, int top_k);
  static void on_submit(void* call);
  static void on_sync(void* call);
  static void on_drop(void* call);
  void count_queued(bool captured);
  void count_completed(bool captured);
  void start(StreamCall& call);
  // Waits for the deferred task in flight (its output stays in its slot for collect_deferred).
  void finish_deferred_locked();
  void finish(StreamCall& call);
  // Waits for `call`'s deferred experts and adds their output to out (null: only wait); false when
  // they did not run. Then the call is free for reuse.
  bool collect_deferred(StreamCall& call, bf16_t* out);
  void keep_error(std::exception_ptr error);
  void release(StreamCall* call);
  static void after_fork_in_child();

  // Two locks, so that the caller's thread never waits for a CPU task: engine_mutex_ is held by
  // the host functions while they use the engines (waiting for a task included) and by close();
  // state_mutex_ guards the records, the counts and the error, for everyone, briefly. Order:
  // engine_mutex_ before state_mutex_. Both are replaced (the old ones leaked) in a fork() child,
  // where a thread that no longer exists may hold them.
  std::mutex* engine_mutex_ = new std::mutex;
  std::mutex* state_mutex_ = new std::mutex;
  MoESubpools* layer_;
  MoESubpools* deferred_;
  const int num_experts_, hidden_, top_k_;
  std::atomic<bool> closed_{false};
  StreamCall* running_ = nullptr;           // the call whose CPU task is in flight (engine_mutex_)
  StreamCall* deferred_running_ = nullptr;  // the call whose deferred task is in flight (engine_mutex_)
  std::deque<StreamCall> calls_;            // every record (stable addresses)
  std::vector<StreamCall*> free_;
  uint64_t queued_ = 0, completed_ = 0;
  std::exception_ptr error_;
};

// Fences: a host function queued on a stream that marks when the stream has run everything queued
// before it. Buffers that queued work may still use are freed only once a fence behind that work
// has passed (kt_kernel/stream_path.py). Returns 0 where the stream is being captured (a fence
// there would be recorded into the graph): try again later.
uint64_t queue_fence(uintptr_t stream);
bool fence_passed(uint64_t fence);

KT_NAMESPACE_END
