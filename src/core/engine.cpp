#include "engine.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "bf16.h"
#include "kernels.h"
#include "packed_file.h"

KT_NAMESPACE_BEGIN
namespace {

// Calls of up to this many tokens (decode) read each weight once.
constexpr int kDecodeMaxTokens = 16;

// Work is split into tasks of task_groups() weight groups: small enough to spread one expert over
// many threads in decode, large enough to reuse activations in prefill and to keep each task's
// weight streams long. Pools of up to kFewWorkers workers take 8 groups (128 rows) in prefill and 16
// in decode; larger pools 4, so each worker still gets several tasks per phase. 2 workers, the Xeon
// VM, qwen3-30b: 8 groups rather than 4 made 12 layers in turn 2-7 % faster at T = 1 and 8 and
// T = 512 4-5 %; 16 rather than 8 made decode at T = 8 and 16 4-8 % faster (with another process
// busy on a core, 14 %) and left T = 1 as it was.
constexpr int kFewWorkers = 4;
int task_groups(int workers, bool decode) {
  if (workers > kFewWorkers) return 4;
  return decode ? 16 : 8;
}

// exp(x) as 2^n * 2^f, f in [0, 1) by a degree-6 polynomial (relative error ~1e-7): written so
// the compiler vectorizes the SwiGLU loop with the variant's ISA.
inline float fast_exp(float x) {
  // Written so NaN becomes -87 (maxps semantics): a NaN gate then gives NaN through the multiply,
  // never an undefined float-to-int conversion below.
  x = x > -87.0f ? x : -87.0f;
  x = x < 88.0f ? x : 88.0f;
  const float t = x * 1.44269504088896341f;
  // floor(t) by truncation of t + 128 > 0: std::floor made this loop 6x slower (4 vs 0.7 ns per
  // element on this project's Xeon).
  const float n = float(int32_t(t + 128.0f)) - 128.0f;
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t exponent_bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return p * scale;
}

// act = silu(g) * u, or the clamped forms of EngineOptions (limit, alpha > 0 switch them on).
void swiglu_to_bf16(const float* gate, const float* up, int count, float limit, float alpha, bf16_t* out) {
  if (limit <= 0.0f && alpha <= 0.0f) {  // the common case, kept a plain loop that vectorizes
    for (int c = 0; c < count; ++c) out[c] = float_to_bf16(gate[c] / (1.0f + fast_exp(-gate[c])) * up[c]);
    return;
  }
  for (int c = 0; c < count; ++c) {
    float g = gate[c], u = up[c];
    if (limit > 0.0f) {
      g = g < limit ? g : limit;
      u = u < limit ? (u > -limit ? u : -limit) : limit;
    }
    out[c] = float_to_bf16(alpha > 0.0f ? g / (1.0f + fast_exp(-alpha * g)) * (u + 1.0f)
                                        : g / (1.0f + fast_exp(-g)) * u);
  }
}

// rows[r][c] += bias[c] for `rows` rows of `cols` values, `stride` apart: an expert's biases, added
// in fp32 to its outputs before they are used.
void add_bias(float* rows_data, int rows, int stride, const float* bias, int cols) {
  for (int r = 0; r < rows; ++r) {
    float* row = rows_data + size_t(r) * stride;
    for (int c = 0; c < cols; ++c) row[c] += bias[c];
  }
}

}  // namespace

MoEEngine::MoEEngine(MoEShape shape, const FormatTraits& format, std::shared_ptr<ThreadPool> pool,
                     const std::vector<int>& skip_experts, const EngineOptions& options)
    : MoEEngine(shape, format, std::move(pool), std::make_shared<ExpertWeights>(), options) {
  weights_->skip.assign(shape.num_experts, 0);
  for (int e : skip_experts) {
    require(e >= 0 && e < shape.num_experts, "gpu_experts_mask names an expert outside [0, num_experts)");
    weights_->skip[e] = 1;
  }
}

MoEEngine::MoEEngine(MoEShape shape, const FormatTraits& format, std::shared_ptr<ThreadPool> pool,
                     std::shared_ptr<ExpertWeights> weights, const EngineOptions& options)
    : shape_(shape),
      format_(format),
      gemm_(kernels().*format.gemm),
      options_(options),
      quantized_activations_(format.quantized_activations()),
      hidden_stride_(round_up(shape.hidden, 32)),
      routed_stride_(round_up(shape.hidden, 32) + kRowPadBytes / sizeof(bf16_t)),
      inter_stride_(round_up(shape.intermediate, 32) + kRowPadBytes / sizeof(bf16_t)),
      weights_(std::move(weights)),
      pool_(std::move(pool)) {
  require(pool_ != nullptr, "an engine needs a thread pool");
  require(shape.num_experts >= 1, "num_experts must be >= 1");
  require(shape.top_k >= 1 && shape.top_k <= shape.num_experts,
          "num_experts_per_tok must be in [1, num_experts]");
  require(shape.hidden >= 1 && shape.intermediate >= 1, "hidden_size and moe_intermediate_size must be >= 1");
  require(shape.hidden <= kMaxDimension && shape.intermediate <= kMaxDimension,
          "hidden_size and moe_intermediate_size must be <= " + std::to_string(kMaxDimension));
  require(shape.hidden % format.k_multiple == 0 && shape.intermediate % format.k_multiple == 0,
          std::string(format.name) + " needs hidden_size and moe_intermediate_size to be multiples of " +
              std::to_string(format.k_multiple));
  require(shape.hidden <= format.max_k && shape.intermediate <= format.max_k,
          std::string(format.name) + " needs hidden_size and moe_intermediate_size <= " +
              std::to_string(format.max_k));
  scratch_.resize(pool_->size() + 1);  // the last for the caller of sync()
  parts_ = quantized_activations_ && !options.int8_activations ? 2 : 1;
  hidden_q_.parts = routed_q_.parts = activation_q_.parts = parts_;
}

std::unique_ptr<MoEEngine> MoEEngine::twin() const {
  return std::unique_ptr<MoEEngine>(new MoEEngine(shape_, format_, pool_, weights_, options_));
}

MoEEngine::~MoEEngine() {
  if (!job_in_pool_) return;
  try {
    pool_->wait_until_left(job_);  // the workers use buffers this object owns
  } catch (...) {  // no threads could be started again in a forked child: nothing runs here
  }
}

void MoEEngine::load(SourceProjection gate, SourceProjection up, SourceProjection down, int num_sources,
                     const int64_t* source_of_slot) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot load weights while a forward is in flight; call sync first");
  const int E = shape_.num_experts, H = shape_.hidden, I = shape_.intermediate;
  bool every_slot = true;
  for (int slot = 0; slot < E; ++slot) {
    require(source_of_slot[slot] >= -1 && source_of_slot[slot] < num_sources,
            "physical_to_logical_map_cpu[" + std::to_string(slot) + "] = " +
                std::to_string(source_of_slot[slot]) + " is outside [0, " + std::to_string(num_sources) + ")");
    every_slot = every_slot && source_of_slot[slot] >= 0;
  }
  ExpertWeights& w = *weights_;
  const bool earlier_parts = std::any_of(w.packed.begin(), w.packed.end(), [](uint8_t p) { return p != 0; });
  const bool same_layout = w.gate.scale_group == gate.scale_group && w.up.scale_group == up.scale_group &&
                           w.down.scale_group == down.scale_group;
  require(every_slot || !earlier_parts || same_layout,
          "a part of a load must have the scale groups of the parts before it (the experts of a layer share them)");
  if (every_slot || !earlier_parts) {
    w.loaded = false;
    w.gate.allocate(format_, E, I, H, gate.scale_group, gate.zeros != nullptr,
                    held_layout(format_, gate, num_sources, I, H));
    w.up.allocate(format_, E, I, H, up.scale_group, up.zeros != nullptr, held_layout(format_, up, num_sources, I, H));
    w.down.allocate(format_, E, H, I, down.scale_group, down.zeros != nullptr,
                    held_layout(format_, down, num_sources, H, I));
    w.packed.assign(E, 0);
  } else {
    // A part the layout so far cannot hold (a valid layer whose later experts differ) is not refused:
    // the projection is held anew in the layout of all its experts (rehold).
    // The slots packed so far may be a mapped file's read-only pages: copied before any is written.
    for (PackedProjection* p : {&w.gate, &w.up, &w.down}) p->own();
    // Checked by the pool's threads, a share of the matrices each (the check reads every value).
    const std::array<std::pair<PackedProjection*, SourceProjection>, 3> projections = {
        std::pair{&w.gate, gate}, std::pair{&w.up, up}, std::pair{&w.down, down}};
    std::array<std::atomic<bool>, 3> held = {true, true, true};
    pool_->run([&](int worker) {
      const size_t first = size_t(num_sources) * worker / pool_->size();
      const size_t last = size_t(num_sources) * (worker + 1) / pool_->size();
      for (size_t p = 0; p < projections.size(); ++p)
        if (!holds(format_, *projections[p].first, projections[p].second, first, last - first)) held[p] = false;
    });
    for (size_t p = 0; p < projections.size(); ++p)
      if (!held[p]) rehold(format_, *projections[p].first, w.packed, projections[p].second, source_of_slot);
    if (gate.zeros != nullptr) w.gate.add_zero_points(format_, E);
    if (up.zeros != nullptr) w.up.add_zero_points(format_, E);
    if (down.zeros != nullptr) w.down.add_zero_points(format_, E);
  }
  // Packed by the pool's threads, so each expert's pages are first touched by a worker. Skipped
  // (GPU) slots too: the mask may hand them back to the CPU at any submit.
  pool_->run([&](int worker) {
    for (int slot = worker; slot < E; slot += pool_->size()) {
      if (source_of_slot[slot] < 0) continue;
      const size_t source = size_t(source_of_slot[slot]);
      pack(w.gate, gate, slot, source);
      pack(w.up, up, slot, source);
      pack(w.down, down, slot, source);
      w.packed[slot] = 1;
    }
  });
  w.loaded = w.ready();
}

size_t MoEEngine::packed_bytes() const {
  size_t bytes = 0;
  for (const PackedProjection* p : {&weights_->gate, &weights_->up, &weights_->down}) {
    bytes += size_t(shape_.num_experts) * (p->expert_value_bytes() + p->expert_scale_bytes() * (1 + p->has_zeros));
    if (p->held.e4m3_scales) bytes += size_t(shape_.num_experts) * sizeof(float);  // the factor per matrix
  }
  return bytes;
}

void MoEEngine::save_packed(const std::string& path, const std::string& meta) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot save weights while a forward is in flight");
  if (!weights_->loaded) throw std::logic_error("weights are not loaded");
  write_packed_file(path, *weights_, shape_, format_, meta);
}

std::string MoEEngine::map_packed(const std::string& path, bool verify_content, std::string* meta) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot map weights while a forward is in flight");
  std::string reason = map_packed_file(path, *weights_, shape_, format_, verify_content, meta);
  if (!reason.empty()) return reason;
  const ExpertWeights& w = *weights_;
  pool_->run([&](int worker) {  // each slot's pages read by the worker that would have packed it
    uint8_t sum = 0;
    for (int slot = worker; slot < shape_.num_experts; slot += pool_->size()) {
      if (!w.packed[slot]) continue;
      for (const PackedProjection* p : {&w.gate, &w.up, &w.down}) {
        const std::array<std::pair<const uint8_t*, size_t>, 3> parts = {
            std::pair{p->values.data(), p->expert_value_bytes()}, std::pair{p->scales.data(), p->expert_scale_bytes()},
            std::pair{p->has_zeros ? p->zeros.data() : nullptr, p->expert_scale_bytes()}};
        for (const auto& [data, bytes] : parts) {
          if (data == nullptr || bytes == 0) continue;
          const uint8_t* first = data + slot * bytes;
          for (size_t at = 0; at < bytes; at += 4096) sum ^= first[at];
          sum ^= first[bytes - 1];
        }
      }
    }
    volatile uint8_t sink = sum;
    (void)sink;
  });
  return "";
}

bool MoEEngine::biases(Projection projection, float* out) const {
  const ExpertWeights& w = *weights_;
  const std::vector<float>& bias =
      projection == Projection::kGate ? w.gate_bias : projection == Projection::kUp ? w.up_bias : w.down_bias;
  if (bias.empty()) return false;
  const int rows = projection == Projection::kDown ? shape_.hidden : shape_.intermediate;
  for (int e = 0; e < shape_.num_experts; ++e)
    std::memcpy(out + size_t(e) * rows, bias_row(bias, e, rows), rows * sizeof(float));
  return true;
}

void MoEEngine::unload() {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot unload weights while a forward is in flight; call sync first");
  std::fill(weights_->packed.begin(), weights_->packed.end(), 0);
  weights_->loaded = false;
}

void MoEEngine::set_biases(const float* gate, const float* up, const float* down) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot set biases while a forward is in flight; call sync first");
  const int E = shape_.num_experts;
  auto copy = [E](std::vector<float>& dst, const float* src, int rows) {
    dst.clear();
    if (src == nullptr) return;
    const size_t padded = size_t(packed_groups(rows)) * kGroupRows;
    dst.assign(size_t(E) * padded, 0.0f);
    for (int e = 0; e < E; ++e) std::memcpy(dst.data() + e * padded, src + size_t(e) * rows, rows * sizeof(float));
  };
  copy(weights_->gate_bias, gate, shape_.intermediate);
  copy(weights_->up_bias, up, shape_.intermediate);
  copy(weights_->down_bias, down, shape_.hidden);
}

void MoEEngine::pack(PackedProjection& dst, SourceProjection src, int slot, size_t source) {
  pack_matrix(format_, src, source, dst, slot);
}

void MoEEngine::set_gpu_experts(const uint8_t* gpu_mask) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot change the GPU experts while a forward is in flight");
  if (std::memcmp(weights_->skip.data(), gpu_mask, weights_->skip.size()) == 0) return;
  if (!weights_->packed.empty())
    for (size_t e = 0; e < weights_->skip.size(); ++e)
      require(gpu_mask[e] || weights_->packed[e],
              "expert " + std::to_string(e) + " is not in CPU memory (skip_gpu_expert_cpu_copy): load it first");
  for (size_t e = 0; e < weights_->skip.size(); ++e) weights_->skip[e] = gpu_mask[e] != 0;
}

void MoEEngine::unpack(Projection projection, int expert, const UnpackRegion& region) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot read weights back while a forward is in flight");
  if (!weights_->loaded) throw std::logic_error("weights are not loaded");
  const ExpertWeights& w = *weights_;
  const PackedProjection& p = projection == Projection::kGate ? w.gate : projection == Projection::kUp ? w.up : w.down;
  require(expert >= 0 && expert < shape_.num_experts, "expert id outside [0, num_experts)");
  require(w.packed[expert], "expert " + std::to_string(expert) +
                                " is not in CPU memory (skip_gpu_expert_cpu_copy): nothing to write back");
  require(region.row0 >= 0 && region.rows >= 0 && region.row0 <= p.rows - region.rows,
          "unpack rows outside the projection");
  require(region.k0 >= 0 && region.cols >= 0 && region.k0 <= p.k - region.cols, "unpack inputs outside the projection");
  const int block = format_.unpack_block(p.scale_group);
  require(region.k0 % block == 0 && region.cols % block == 0, "unpack inputs must keep scale blocks whole");
  require(region.rows == 0 || region.cols == 0 ||
              (region.values != nullptr && (!format_.has_scales() || region.scales != nullptr)),
          "unpack needs destinations for the values and scales");
  const PackedGroups all = p.groups(expert, 0, packed_groups(p.rows));
  pool_->run([&](int worker) {
    // Worker w writes rows [w * rows / workers, (w + 1) * rows / workers) of the region.
    const int first = int(int64_t(worker) * region.rows / pool_->size());
    const int last = int(int64_t(worker + 1) * region.rows / pool_->size());
    UnpackRegion share = region;
    share.row0 += first;
    share.rows = last - first;
    share.values += first * region.values_stride;
    if (share.scales != nullptr) share.scales += first * region.scales_stride;
    format_.unpack(all, share);
  });
}

void MoEEngine::submit(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights,
                       bf16_t* out) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  start(hidden, tokens, ids, weights, out, nullptr);
}

void MoEEngine::submit(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights, float* out) {
  std::lock_guard<std::mutex> lock(api_mutex_);
  start(hidden, tokens, ids, weights, nullptr, out);
}

void MoEEngine::start(const bf16_t* hidden, int tokens, const int64_t* ids, const float* weights, bf16_t* out,
                      float* out_f32) {
  if (!weights_->loaded) throw std::logic_error("weights are not loaded");
  if (pending_) throw std::logic_error("a forward is already submitted; call sync first");
  require(tokens >= 1, "the engine needs at least one token");
  if (job_in_pool_) pool_->wait_until_left(job_), job_in_pool_ = false;  // nobody reads the old call
  const int K = shape_.top_k;
  require(int64_t(tokens) * K <= INT32_MAX, "tokens * num_experts_per_tok must be < 2^31");
  const bool decode = tokens <= kDecodeMaxTokens;
  // In decode the workers also claim each task before the one they run ends (run_phase): its weight
  // prefetches then run on into the next task's (2 workers, the Xeon VM, qwen3-30b, INT4 and MXFP4
  // T = 1 and 8: 1-3 % faster; at T = 64 INT4 was 3 % slower).
  claim_ahead_ = decode;
  routed_ = !decode;
  block_groups_ = task_groups(pool_->size(), decode);
  block_cols_ = block_groups_ * kGroupRows;

  routing_.bucket(ids, weights, tokens, K, weights_->skip, parts_);
  reserve_buffers(tokens);
  copy_tokens(hidden, tokens);
  begin_phases(tokens, out, out_f32);
  // A tiny problem is done right here: handing it to the pool and waking this thread again would
  // cost more than the work.
  ran_inline_ = double(routing_.total_rows) * 3 * shape_.hidden * shape_.intermediate <= options_.inline_multiply_adds;
  if (ran_inline_) {
    forward_worker(0);
  } else {
    may_stand_in_ = pool_->all_asleep();
    job_ = pool_->submit([this](int worker) { forward_worker(worker); });
    job_in_pool_ = true;
  }
}

// Buffers only grow, so steady-state calls allocate nothing. The routed rows are followed by
// kPaddedRows rows of zeros (Activations::padded_rows).
void MoEEngine::reserve_buffers(int tokens) {
  const int padded_rows = routing_.total_rows + kPaddedRows;
  hidden_.reserve(size_t(tokens) * hidden_stride_);
  activation_.reserve(size_t(padded_rows) * inter_stride_);
  if (routed_) routed_hidden_.reserve(size_t(padded_rows) * routed_stride_);
  if (quantized_activations_) {
    hidden_q_.reserve(tokens, shape_.hidden);
    activation_q_.reserve(padded_rows, shape_.intermediate);
    if (routed_) routed_q_.reserve(padded_rows, shape_.hidden);
  }
  if (routed_) {
    std::memset(routed_hidden_.data() + size_t(routing_.total_rows) * routed_stride_, 0,
                size_t(kPaddedRows) * routed_stride_ * sizeof(bf16_t));
    std::memset(activation_.data() + size_t(routing_.total_rows) * inter_stride_, 0,
                size_t(kPaddedRows) * inter_stride_ * sizeof(bf16_t));
    if (quantized_activations_) {
      routed_q_.zero_rows(routing_.total_rows, kPaddedRows);
      activation_q_.zero_rows(routing_.total_rows, kPaddedRows);
    }
  }
  for (ThreadScratch& s : scratch_) {
    s.kernel.reserve(kernel_scratch_bytes(routing_.max_rows * parts_, std::max(shape_.hidden, shape_.intermediate)));
    s.gate.reserve(size_t(routing_.max_rows) * parts_ * block_cols_);
    s.up.reserve(size_t(routing_.max_rows) * parts_ * block_cols_);
    s.down.reserve(size_t(routing_.max_rows) * parts_ * block_cols_);
    s.acc.reserve(size_t(tokens) * block_cols_);
  }

}

// The tokens are copied here, on the caller, so it may reuse `hidden` as soon as submit returns.
void MoEEngine::copy_tokens(const bf16_t* hidden, int tokens) {
  const int H = shape_.hidden;
  for (int t = 0; t < tokens; ++t) {
    bf16_t* row = hidden_.data() + size_t(t) * hidden_stride_;
    std::memcpy(row, hidden + size_t(t) * H, H * sizeof(bf16_t));
    std::memset(row + H, 0, (hidden_stride_ - H) * sizeof(bf16_t));
  }
}

// The call's state for its workers: where it writes, and each phase's items.
void MoEEngine::begin_phases(int tokens, bf16_t* out, float* out_f32) {
  out_ = out;
  out_f32_ = out_f32;
  tokens_ = tokens;
  prepare_hidden_.reset(quantized_activations_ || routed_ ? tokens : 0);
  gate_up_.reset(int(routing_.active_experts.size()) * ceil_div(packed_groups(shape_.intermediate), block_groups_));
  quantize_activation_.reset(quantized_activations_ ? routing_.total_rows : 0);
  down_.reset(ceil_div(packed_groups(shape_.hidden), block_groups_));
  call_done_.store(false);
  workers_in_.store(0);
  failed_.store(false);
  failure_ = nullptr;
  pending_ = true;
}

void MoEEngine::sync() {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (!pending_) throw std::logic_error("sync without a submitted forward");
  pending_ = false;
  if (!ran_inline_) {
    // Workers that were all asleep at submit start only once woken (tens to hundreds of microseconds
    // on a virtual machine): this thread takes items until the call is done rather than sleep. Not
    // when some were awake: an extra thread then only competes with them for the CPUs.
    if (may_stand_in_ && workers_in_.load() < pool_->size() && !call_done_.load()) {
      pool_->throw_if_lost(job_);  // after a fork, items the parent's workers held never finish
      forward_worker(pool_->size());
    }
    pool_->wait(job_, call_done_);
  }
  if (failed_.load()) std::rethrow_exception(failure_);
}

void MoEEngine::Phase::reset(int count) {
  items = count;
  next.store(0, std::memory_order_relaxed);
  done.store(0, std::memory_order_relaxed);
}

template <typename Item>
bool MoEEngine::run_phase(Phase& phase, Item item) {
  bool finished_last = false;
  const auto claim = [&] { return phase.next.fetch_add(1, std::memory_order_relaxed); };
  for (int i = claim(); i < phase.items;) {
    // In decode the next item is claimed before this one runs, while more are left than there are
    // workers, so this one's weight prefetches run on into the next one's (no stream starts cold).
    const bool ahead = claim_ahead_ && phase.items - phase.next.load(std::memory_order_relaxed) > pool_->size();
    const int next = ahead ? claim() : -1;
    guarded([&] { item(i, next < phase.items ? next : -1); });
    if (phase.done.fetch_add(1, std::memory_order_acq_rel) + 1 == phase.items) {
      phase.done.notify_all();
      finished_last = true;
    }
    i = next >= 0 ? next : claim();
  }
  return finished_last;
}

template <typename Task>
void MoEEngine::guarded(Task task) noexcept {
  if (failed_.load(std::memory_order_relaxed)) return;
  try {
    task();
  } catch (...) {
    if (!failed_.exchange(true)) failure_ = std::current_exception();
  }
}

void MoEEngine::release_scratch() {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot release buffers while a forward is in flight");
  if (job_in_pool_) pool_->wait_until_left(job_), job_in_pool_ = false;
  hidden_.release();
  routed_hidden_.release();
  activation_.release();
  hidden_q_.release();
  routed_q_.release();
  activation_q_.release();
  for (ThreadScratch& s : scratch_) s = ThreadScratch{};
}

std::vector<std::vector<int>> MoEEngine::worker_cpus() {
  std::lock_guard<std::mutex> lock(api_mutex_);
  if (pending_) throw std::logic_error("cannot query the workers while a forward is in flight");
  return pool_->worker_cpus();
}

// One worker's part of the call: the phases in turn, each begun once the one before is done. Kernels
// that read int8 activations get each token and each intermediate row quantized once, whole, before
// the projections read it: as a row and its residual row by default (QuantizedBuffer), so the GEMMs
// see parts_ rows per activation row.
void MoEEngine::forward_worker(int worker) {
  ThreadScratch& s = scratch_[worker];
  workers_in_.fetch_add(1, std::memory_order_relaxed);
  run_phase(prepare_hidden_, [&](int t, int) { prepare_hidden_row(t); });
  wait_for_count(prepare_hidden_.done, prepare_hidden_.items);
  run_phase(gate_up_, [&](int task, int next) { gate_up_task(task, next, s); });
  wait_for_count(gate_up_.done, gate_up_.items);
  run_phase(quantize_activation_, [&](int row, int) {
    activation_q_.quantize(row, activation_.data() + size_t(row) * inter_stride_, shape_.intermediate, format_);
  });
  wait_for_count(quantize_activation_.done, quantize_activation_.items);
  if (run_phase(down_, [&](int block, int next) { down_task(block, next, s); })) {
    call_done_.store(true, std::memory_order_release);
    if (!ran_inline_) pool_->notify_done();
  }
}

// Token t's hidden row: quantized (integer formats), and copied to its routed rows (routed_).
void MoEEngine::prepare_hidden_row(int t) {
  const bf16_t* row = hidden_.data() + size_t(t) * hidden_stride_;
  if (quantized_activations_) hidden_q_.quantize(t, row, shape_.hidden, format_);
  if (!routed_) return;
  const int K = shape_.top_k;
  for (int k = 0; k < K; ++k) {
    const int routed = routing_.token_rows[size_t(t) * K + k];
    if (routed < 0) continue;
    bf16_t* dst = routed_hidden_.data() + size_t(routed) * routed_stride_;
    std::memcpy(dst, row, hidden_stride_ * sizeof(bf16_t));
    std::memset(dst + hidden_stride_, 0, (routed_stride_ - hidden_stride_) * sizeof(bf16_t));
    if (quantized_activations_) routed_q_.copy_row(routed, hidden_q_, t);
  }
}

// One expert x one block of intermediate rows: gate and up for all its tokens, then SwiGLU.
void MoEEngine::gate_up_task(int task, int next_task, ThreadScratch& s) {
  const int groups = packed_groups(shape_.intermediate);
  const int blocks = ceil_div(groups, block_groups_);
  const int active = task / blocks, g0 = task % blocks * block_groups_;
  const int block_groups = std::min(block_groups_, groups - g0);
  const int expert = routing_.active_experts[active];
  const int first = routing_.offset[active], rows = routing_.offset[active + 1] - first;
  // The integer formats read each token's quantized parts as rows of their own (routing_.parts).
  Activations x{hidden_.data(), size_t(hidden_stride_), routing_.token.data() + first, rows};
  if (routed_) {
    x = {routed_hidden_.data() + size_t(first) * routed_stride_, size_t(routed_stride_), nullptr, rows * parts_};
    if (quantized_activations_) x.quantized = routed_q_.view(first);
    x.padded_rows = true;
  } else if (quantized_activations_) {
    x = {hidden_.data(), size_t(hidden_stride_), routing_.parts.data() + size_t(first) * parts_, rows * parts_,
         hidden_q_.view()};
  }
  x.scratch = s.kernel.data();

  PackedGroups gate = weights_->gate.groups(expert, g0, block_groups);
  PackedGroups up = weights_->up.groups(expert, g0, block_groups);
  gate.next_values = up.values;
  if (next_task >= 0) {  // up's prefetches run on into the first gate group of the worker's next task
    const int next_expert = routing_.active_experts[next_task / blocks], next_g0 = next_task % blocks * block_groups_;
    up.next_values = weights_->gate.groups(next_expert, next_g0, 1).values;
  }
  gemm_(x, gate, s.gate.data(), block_cols_);
  gemm_(x, up, s.up.data(), block_cols_);
  sum_parts(s.gate.data(), rows, parts_, block_groups * kGroupRows, block_cols_);
  sum_parts(s.up.data(), rows, parts_, block_groups * kGroupRows, block_cols_);
  const int I = shape_.intermediate, col0 = g0 * kGroupRows;
  if (const float* bias = bias_row(weights_->gate_bias, expert, I))
    add_bias(s.gate.data(), rows, block_cols_, bias + col0, block_groups * kGroupRows);
  if (const float* bias = bias_row(weights_->up_bias, expert, I))
    add_bias(s.up.data(), rows, block_cols_, bias + col0, block_groups * kGroupRows);
  for (int i = 0; i < rows; ++i)
    swiglu_to_bf16(s.gate.data() + i * block_cols_, s.up.data() + i * block_cols_, block_groups * kGroupRows,
                   options_.swiglu_limit, options_.swiglu_alpha, activation_.data() + size_t(first + i) * inter_stride_ + g0 * kGroupRows);
}

// One block of output columns for every token: down projections of all active experts, weighted
// and summed in fp32, written once (bf16, or fp32 for a subpool's partial). Tasks own disjoint
// columns, so no atomics are needed.
void MoEEngine::down_task(int block, int next_block, ThreadScratch& s) {
  const int H = shape_.hidden;
  const int g0 = block * block_groups_, block_groups = std::min(block_groups_, packed_groups(H) - g0);
  const int block_cols = block_groups * kGroupRows;
  float* acc = s.acc.data();
  std::memset(acc, 0, size_t(tokens_) * block_cols_ * sizeof(float));
  for (size_t active = 0; active < routing_.active_experts.size(); ++active) {
    const int expert = routing_.active_experts[active];
    const int first = routing_.offset[active], rows = routing_.offset[active + 1] - first;
    Activations x{activation_.data() + size_t(first) * inter_stride_, size_t(inter_stride_), nullptr, rows * parts_};
    if (quantized_activations_) x.quantized = activation_q_.view(first);
    x.padded_rows = routed_;
    x.scratch = s.kernel.data();
    PackedGroups down = weights_->down.groups(expert, g0, block_groups);
    if (active + 1 < routing_.active_experts.size())
      down.next_values = weights_->down.groups(routing_.active_experts[active + 1], g0, block_groups).values;
    else if (next_block >= 0)
      down.next_values = weights_->down.groups(routing_.active_experts[0], next_block * block_groups_, 1).values;
    gemm_(x, down, s.down.data(), block_cols_);
    sum_parts(s.down.data(), rows, parts_, block_cols, block_cols_);
    if (const float* bias = bias_row(weights_->down_bias, expert, H))
      add_bias(s.down.data(), rows, block_cols_, bias + g0 * kGroupRows, block_cols);
    for (int i = 0; i < rows; ++i) {
      const float weight = routing_.weight[first + i];
      const float* y = s.down.data() + i * block_cols_;
      float* dst = acc + size_t(routing_.token[first + i]) * block_cols_;
      for (int c = 0; c < block_cols; ++c) dst[c] += weight * y[c];
    }
  }
  const int col0 = g0 * kGroupRows, cols = std::min(block_cols, H - col0);
  if (out_f32_ != nullptr) {
    for (int t = 0; t < tokens_; ++t)
      std::memcpy(out_f32_ + size_t(t) * H + col0, acc + size_t(t) * block_cols_, cols * sizeof(float));
    return;
  }
  for (int t = 0; t < tokens_; ++t) {
    bf16_t* dst = out_ + size_t(t) * H + col0;
    const float* src = acc + size_t(t) * block_cols_;
    for (int c = 0; c < cols; ++c) dst[c] = float_to_bf16(src[c]);
  }
}

KT_NAMESPACE_END
