// The MoE expert engine: runs calls on a layer's packed experts (packed_weights.h) on a thread pool,
//   out[t] = sum_k w[t,k] * down_e( silu(gate_e(x_t)) * up_e(x_t) ),  e = ids[t,k]
// for the routed experts kept on the CPU; with the expert biases loaded (ExpertWeights) added to
// gate, up and down, and the clamped SwiGLU of EngineOptions in place of silu(g) * u.
#pragma once

#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "activation_rows.h"
#include "common.h"
#include "formats.h"
#include "kernels.h"
#include "packed_weights.h"
#include "routing.h"
#include "thread_pool.h"

KT_NAMESPACE_BEGIN

struct MoEShape {
  int num_experts;
  int top_k;
  int hidden;
  int intermediate;
};

// Calls of at most this many multiply-adds (tens of microseconds on one core) run on the caller.
constexpr double kInlineMultiplyAdds = 2e6;

struct EngineOptions {
  // A subpool of a split layer gets its share of the threshold, so the whole layer's work decides.
  double inline_multiply_adds = kInlineMultiplyAdds;
  // The integer formats quantize each activation row to int8 once (faster, lossy: see kernels.h).
  bool int8_activations = false;
  // Clamped SwiGLU (0: off). limit L > 0: gate = min(gate, L), up = clamp(up, -L, L) first;
  // alpha a > 0: act = gate * sigmoid(a * gate) * (up + 1) (SwiGLU-OAI), else silu(gate) * up.
  float swiglu_limit = 0.0f, swiglu_alpha = 0.0f;
};

enum class Projection { kGate, kUp, kDown };

// An invalid argument from the caller: std::invalid_argument (ValueError in Python).
inline void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

class MoEEngine {
 public:
  // skip_experts: ids computed elsewhere (GPU-resident); their routing entries are ignored until
  // set_gpu_experts changes the set.
  // pool: the worker threads it runs on, shared with other engines (other layers): their calls
  // take turns on it in submit order.
  MoEEngine(MoEShape shape, const FormatTraits& format, std::shared_ptr<ThreadPool> pool,
            const std::vector<int>& skip_experts, const EngineOptions& options = {});
  ~MoEEngine();

  // gate, up: [num_sources, intermediate, hidden]; down: [num_sources, hidden, intermediate], in
  // the engine's format. Physical slot p gets the weights of source expert source_of_slot[p].
  // Copies and packs; nothing refers to the sources afterwards.
  // A load in parts (a layer read a few experts at a time, so that only those experts' sources
  // exist at once) starts with unload(); then source_of_slot[p] = -1 leaves slot p to another part.
  // The parts must share their scale groups; zero points given for some parts only mean zero
  // points of 0 for the others. The engine runs once every slot is packed or skipped: a skipped
  // (GPU) slot may stay unpacked, out of CPU memory, until a later load packs it; set_gpu_experts
  // refuses to hand it to the CPU before that.
  void load(SourceProjection gate, SourceProjection up, SourceProjection down, int num_sources,
            const int64_t* source_of_slot);
  // Every slot unpacked (the memory is kept for the next load): a load in parts starts here.
  void unload();
  // Expert biases per slot, fp32, each nullable: gate and up [num_experts, intermediate], down
  // [num_experts, hidden] (all null: none). Copied; kept until the next call of this.
  void set_biases(const float* gate, const float* up, const float* down);
  // gpu_mask[e] != 0 (num_experts bytes, 0 or 1): expert e is computed elsewhere and its routing
  // entries are ignored from the next submit on. Compares first, so an unchanged mask costs a
  // memcmp. Not while a forward is in flight. A mask that hands the CPU an expert whose slot is not
  // packed is refused (std::invalid_argument) and the set is kept.
  void set_gpu_experts(const uint8_t* gpu_mask);
  // Writes slot `expert`'s rows and inputs of one projection given by `region` back in the
  // canonical layout (UnpackRegion), on the pool's threads. Not while a forward is in flight.
  void unpack(Projection projection, int expert, const UnpackRegion& region);
  // An engine on the same weights, mask and threads with a call state of its own, so a second
  // call of this layer can be in flight (deferred experts). Loads go through the first engine.
  std::unique_ptr<MoEEngine> twin() const;

  // Starts a forward over `tokens` rows and returns at once (a tiny one is computed right away).
  // Routing and hidden (bf16 [tokens, hidden]) are read here, so the caller may reuse them at once;
  // out (bf16 [tokens, hidden]) must stay valid until sync(). An fp32 `out` gets the sums before
  // rounding (a subpool's partial output, see MoESubpools). Every public method may be called from
  // any thread: they take turns.
  void submit(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights, bf16_t* out);
  void submit(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights, float* out);
  // Waits for the forward; rethrows what a worker threw (std::bad_alloc from a kernel, say). While a
  // worker has not begun its part, the calling thread does work of the call in its place.
  void sync();
  bool pending() const { return pending_; }
  // Frees the per-call scratch buffers (they grow back on the next call).
  void release_scratch();
  // The CPUs each worker thread may run on, read back from the kernel by the worker itself.
  std::vector<std::vector<int>> worker_cpus();
  const MoEShape& shape() const { return shape_; }
  const FormatTraits& format() const { return format_; }
  // Bytes of the packed weights (values, scales and zero points of every slot).
  size_t packed_bytes() const;
  // The packed weights, packed mask and biases written to a new file `path` with the caller's
  // `meta` bytes (packed_file.h), for later loads to map. Not while a forward is in flight.
  void save_packed(const std::string& path, const std::string& meta);
  // The weights of the file `path` mapped read-only in place of a load (packed_file.h): "" and the
  // file's meta bytes in *meta, or why the file cannot be used (the weights are then as they were).
  // The pool's threads read each slot's pages first, as a load packs them (first touch places pages
  // the kernel reads from disk on their NUMA node). A later load in parts (an expert handed back)
  // copies the mapped weights into owned memory first.
  std::string map_packed(const std::string& path, bool verify_content, std::string* meta);
  // Whether the weights are views of a mapped file.
  bool mapped() const { return weights_->gate.mapped(); }
  // Each slot's biases of one projection, unpadded, into out [num_experts, rows]; false where none.
  bool biases(Projection projection, float* out) const;
  // The engine's threads, for work on its CPUs between forwards (the subpools' reduction).
  ThreadPool& pool() { return *pool_; }

 private:
  struct ThreadScratch {
    AlignedBuffer<float> gate, up, acc, down;
    AlignedBuffer<uint8_t> kernel;  // Activations::scratch
  };

  MoEEngine(MoEShape shape, const FormatTraits& format, std::shared_ptr<ThreadPool> pool,
            std::shared_ptr<ExpertWeights> weights, const EngineOptions& options);
  void start(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights, bf16_t* out,
             float* out_f32);
  // One phase of a call: items claimed one at a time by whichever worker is free. A phase needs its
  // items done, not every worker: a worker that the OS runs late (or not at all, while another
  // process has its core) finds the work done by the others and holds nobody up.
  struct Phase {
    std::atomic<int> next{0}, done{0};
    int items = 0;
    void reset(int count);
  };
  void forward_worker(int worker);
  // Runs items of `phase` until none is left, item(index, the index of the item this worker runs
  // next or -1); true on the worker that finished its last item.
  template <typename Item>
  bool run_phase(Phase& phase, Item item);
  // Runs one item; the first exception is kept for sync() and the rest of the call's items are
  // skipped (still counted done: a throw must not leave a worker, nor stall a phase).
  template <typename Task>
  void guarded(Task task) noexcept;
  void reserve_buffers(int tokens);
  void copy_tokens(const bf16_t* hidden, int tokens);
  void begin_phases(int tokens, bf16_t* out, float* out_f32);
  void prepare_hidden_row(int t);
  void gate_up_task(int task, int next_task, ThreadScratch& scratch);
  void down_task(int block, int next_block, ThreadScratch& scratch);
  void pack(PackedProjection& dst, SourceProjection src, int slot, size_t source);

  std::mutex api_mutex_;  // held by each public method: callers on several threads take turns
  const MoEShape shape_;
  const FormatTraits& format_;
  const GemmFn gemm_;  // format_'s GEMM in this build
  const EngineOptions options_;
  const bool quantized_activations_;  // format_.quantized_activations()
  int parts_ = 1;                     // quantized rows per activation row (QuantizedBuffer)
  int block_groups_ = 4, block_cols_ = 4 * kGroupRows;  // weight groups (and rows) per task of the call
  bool pending_ = false;
  bool claim_ahead_ = false;  // the call in flight is a decode: run_phase claims items one ahead
  bool ran_inline_ = false;  // the call in flight was done by submit() itself
  ThreadPool::Ticket job_ = 0;  // the pool's job of the last call that used the pool
  // Workers may still be inside job_ (a late one passing through after the work was done): the call
  // state must not change until they have left.
  bool job_in_pool_ = false;
  std::atomic<bool> call_done_{false};  // every item of the call in flight is done
  bool may_stand_in_ = false;           // sync() may take items: the workers were asleep at submit
  std::atomic<int> workers_in_{0};      // threads that have begun their part of the call in flight
  int hidden_stride_, routed_stride_, inter_stride_;  // activation row strides, zero padded
  std::shared_ptr<ExpertWeights> weights_;

  // State of the call in flight.
  bf16_t* out_ = nullptr;       // one of these two is set
  float* out_f32_ = nullptr;
  int tokens_ = 0;
  Routing routing_;                      // its (token, expert) pairs, bucketed by expert
  // Prefill (more than kDecodeMaxTokens tokens): gate and up read each token's hidden row copied to
  // its routed rows (routed_hidden_, routed_q_), so an expert's rows lie together and a tile kernel
  // reads them in place instead of gathering them in every task.
  bool routed_ = false;
  AlignedBuffer<bf16_t> hidden_;         // [tokens, hidden_stride_]
  AlignedBuffer<bf16_t> routed_hidden_;  // [routed rows + kPaddedRows, routed_stride_] (routed_)
  AlignedBuffer<bf16_t> activation_;     // [routed rows + kPaddedRows, inter_stride_]: silu(gate) * up
  // The same rows quantized (integer formats).
  QuantizedBuffer hidden_q_, routed_q_, activation_q_;
  std::vector<ThreadScratch> scratch_;
  // The phases, in order: hidden rows quantized (integer formats) and copied to their routed rows
  // (routed_), gate/up tasks, intermediate rows quantized (integer formats), down tasks.
  Phase prepare_hidden_, gate_up_, quantize_activation_, down_;
  std::atomic<bool> failed_{false};
  std::exception_ptr failure_;  // the first exception of the call in flight; set once failed_ is won

  std::shared_ptr<ThreadPool> pool_;
};

KT_NAMESPACE_END
