// The MoE expert engine: owns the packed expert weights and a thread pool, and computes
//   out[t] = sum_k w[t,k] * down_e( silu(gate_e(x_t)) * up_e(x_t) ),  e = ids[t,k]
// for the routed experts kept on the CPU. See DESIGN.md, "Data flow of one forward call".
#pragma once

#include <vector>

#include "common.h"
#include "thread_pool.h"

KT_NAMESPACE_BEGIN

struct MoEShape {
  int num_experts;
  int top_k;
  int hidden;
  int intermediate;
};

class MoEEngine {
 public:
  // skip_experts: ids computed elsewhere (GPU-resident); their routing entries are ignored.
  MoEEngine(MoEShape shape, int threads, const std::vector<int>& skip_experts);
  ~MoEEngine();

  // gate, up: [num_sources, intermediate, hidden]; down: [num_sources, hidden, intermediate], bf16.
  // Physical slot p gets the weights of source expert source_of_slot[p]. Copies and packs.
  void load_bf16(const bf16_t* gate, const bf16_t* up, const bf16_t* down, int num_sources,
                 const int64_t* source_of_slot);

  // Starts a forward over `tokens` rows and returns at once. Routing is read (and checked) here;
  // hidden (bf16 [tokens, hidden]) and out (bf16 [tokens, hidden]) must stay valid until sync().
  void submit(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights, bf16_t* out);
  void sync();
  bool pending() const { return pending_; }
  // Frees the per-call scratch buffers (they grow back on the next call).
  void release_scratch();

 private:
  struct ThreadScratch {
    AlignedBuffer<float> gate, up, acc, down;
  };

  void forward_worker(int worker);
  void gate_up_task(int task, ThreadScratch& scratch);
  void down_task(int block, ThreadScratch& scratch);

  const MoEShape shape_;
  std::vector<uint8_t> skip_;
  bool loaded_ = false;
  bool pending_ = false;
  // Packed weights, all experts back to back; expert e starts at e * *_expert_elems_.
  AlignedBuffer<bf16_t> gate_, up_, down_;
  size_t gate_up_expert_elems_ = 0, down_expert_elems_ = 0;
  int hidden_stride_, inter_stride_;  // activation row strides, zero padded

  // State of the call in flight.
  const bf16_t* hidden_in_ = nullptr;
  bf16_t* out_ = nullptr;
  int tokens_ = 0;
  std::vector<int> active_experts_;      // experts with work, in id order
  std::vector<int> route_offset_;        // per active expert: first routed row; last = total rows
  std::vector<int32_t> route_token_;     // per routed row: its token
  std::vector<float> route_weight_;      // per routed row: its routing weight
  std::vector<int> expert_rows_;         // per expert id: routed rows (counting pass)
  AlignedBuffer<bf16_t> hidden_;         // [tokens, hidden_stride_]
  AlignedBuffer<bf16_t> activation_;     // [routed rows, inter_stride_]: silu(gate) * up
  std::vector<ThreadScratch> scratch_;
  std::atomic<int> next_gate_up_task_{0}, next_down_task_{0};
  int gate_up_tasks_ = 0, down_tasks_ = 0;

  ThreadPool pool_;
};

KT_NAMESPACE_END
