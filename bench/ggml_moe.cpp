// The MoE layer of `python -m kt_kernel bench --model` run by ggml, for the comparison in
// docs/perf-log/2026-11-25-xeon-against-ggml.md. Not part of the package: build it against a ggml
// source tree (ggml/ of llama.cpp, or the one vendored by the llama-cpp-python sdist):
//
//   cmake -S ggml -B ggml-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF
//   cmake --build ggml-build -j
//   g++ -O2 -std=c++17 bench/ggml_moe.cpp -Iggml/include -Lggml-build/src -lggml -lggml-cpu -lggml-base -lpthread -o ggml_moe
//   ./ggml_moe q4_0 1 12 6 100 [cache_clear_mib]
//   ./ggml_moe q4_K,q4_K,q6_K 512 1 1 5      # gate, up, down of their own types (Q4_K_M's mix)
//
// For the AVX2-only comparison, configure ggml with -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
// -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF instead of -DGGML_NATIVE=ON (and
// -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF for the tree vendored by the sdist, which lacks them).
//
// Arguments: weight type (ggml's name: q4_0, mxfp4, q8_0, q4_K, q6_K, iq4_xs, bf16, ...; or three,
// comma-separated, for gate, up and down), tokens T, layers L, weight sets S, steps. The
// shape is qwen3-30b's (E=128, K=8, H=2048, I=768); 2 threads on a persistent ggml threadpool (the
// calling thread is one of them). Each layer is llama.cpp's MoE graph (build_moe_ffn): mul_mat_id
// for up and gate, swiglu_split, mul_mat_id for down, the routing weights, the sum over the K
// experts. Weights are placed in the CPU_REPACK buffer where ggml repacks their type on x86 (q4_0,
// q4_K, iq4_nl, mxfp4 on AVX2 and up, q2_K on AVX512: ggml's repack.cpp), as llama.cpp does. Layer l uses weight set l % S; every call draws fresh routing.
// Prints the median ms of layer 0 called back to back, and the median over steps of the per-layer
// ms of the L layers called in turn (only the graph computes are timed), with an optional read of
// a separate buffer before each layer.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

constexpr int kExperts = 128, kTopK = 8, kHidden = 2048, kInter = 768, kThreads = 2;

struct Weights {
  ggml_tensor *gate, *up, *down;
};

struct LayerGraph {
  ggml_context* ctx;
  ggml_cgraph* graph;
  ggml_tensor *x, *ids, *route_weights;
};

// The ggml type named `name` (ggml_type_name's spelling); exits on an unknown one.
ggml_type type_named(const std::string& name) {
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const char* type_name = ggml_type_name(ggml_type(t));
    if (type_name != nullptr && name == type_name) return ggml_type(t);
  }
  std::fprintf(stderr, "unknown ggml type %s\n", name.c_str());
  std::exit(2);
}

// Whether ggml's CPU_REPACK buffer takes tensors of `type` on this x86 CPU (repack.cpp).
bool repacked_on_x86(ggml_type type) {
  return type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4 ||
         (type == GGML_TYPE_Q2_K && ggml_cpu_has_avx512());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s TYPE|GATE,UP,DOWN T layers sets steps [cache_clear_mib]\n", argv[0]);
    return 2;
  }
  const std::string name = argv[1];
  const int tokens = std::atoi(argv[2]), layers = std::atoi(argv[3]), sets = std::atoi(argv[4]);
  const int steps = std::atoi(argv[5]), clear_mib = argc > 6 ? std::atoi(argv[6]) : 0;
  ggml_type types[3];  // gate, up, down
  for (int p = 0, start = 0; p < 3; ++p) {
    const size_t comma = name.find(',', start);
    types[p] = type_named(name.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) {
      for (int q = p + 1; q < 3; ++q) types[q] = types[p];
      break;
    }
    start = int(comma) + 1;
  }

  ggml_cpu_init();
  ggml_backend_t backend = ggml_backend_cpu_init();
  ggml_threadpool_params pool_params = ggml_threadpool_params_default(kThreads);
  ggml_threadpool* pool = ggml_threadpool_new(&pool_params);
  ggml_backend_cpu_set_threadpool(backend, pool);
  ggml_backend_cpu_set_n_threads(backend, kThreads);

  ggml_backend_dev_t device = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
  auto extra_types = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
      ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(device), "ggml_backend_dev_get_extra_bufts"));
  ggml_backend_buffer_type_t repack_buffer = nullptr;
  if (extra_types != nullptr)
    for (ggml_backend_buffer_type_t* t = extra_types(device); t != nullptr && *t != nullptr; ++t)
      if (std::string(ggml_backend_buft_name(*t)) == "CPU_REPACK") repack_buffer = *t;
  const auto buffer_of = [&](ggml_type type) {
    return repack_buffer != nullptr && repacked_on_x86(type) ? repack_buffer : ggml_backend_cpu_buffer_type();
  };
  const bool repacked = buffer_of(types[0]) != ggml_backend_cpu_buffer_type() ||
                        buffer_of(types[2]) != ggml_backend_cpu_buffer_type();

  // One expert's matrix quantized once and repeated over the experts (the timing does not depend on
  // the values); every weight set gets its own copy in memory.
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const auto experts_of = [&](ggml_type type, int rows, int cols) {
    std::vector<float> values(size_t(rows) * cols);
    for (float& v : values) v = normal(rng);
    std::vector<uint8_t> one(ggml_row_size(type, cols) * rows);
    if (type == GGML_TYPE_BF16)
      ggml_fp32_to_bf16_row(values.data(), reinterpret_cast<ggml_bf16_t*>(one.data()), int64_t(values.size()));
    else
      ggml_quantize_chunk(type, values.data(), one.data(), 0, rows, cols, nullptr);
    std::vector<uint8_t> all(one.size() * kExperts);
    for (int e = 0; e < kExperts; ++e) std::memcpy(all.data() + e * one.size(), one.data(), one.size());
    return all;
  };
  const std::vector<uint8_t> gate_bytes = experts_of(types[0], kInter, kHidden);
  const std::vector<uint8_t> up_bytes = experts_of(types[1], kInter, kHidden);
  const std::vector<uint8_t> down_bytes = experts_of(types[2], kHidden, kInter);
  std::vector<Weights> weight_sets(sets);
  for (Weights& w : weight_sets) {
    // One context per tensor: each goes to the buffer its type takes.
    const auto tensor_of = [&](ggml_type type, int cols, int rows) {
      ggml_init_params params = {ggml_tensor_overhead(), nullptr, true};
      ggml_context* ctx = ggml_init(params);
      ggml_tensor* t = ggml_new_tensor_3d(ctx, type, cols, rows, kExperts);
      ggml_backend_alloc_ctx_tensors_from_buft(ctx, buffer_of(type));
      return t;
    };
    w.gate = tensor_of(types[0], kHidden, kInter);
    w.up = tensor_of(types[1], kHidden, kInter);
    w.down = tensor_of(types[2], kInter, kHidden);
    ggml_backend_tensor_set(w.gate, gate_bytes.data(), 0, gate_bytes.size());
    ggml_backend_tensor_set(w.up, up_bytes.data(), 0, up_bytes.size());
    ggml_backend_tensor_set(w.down, down_bytes.data(), 0, down_bytes.size());
  }

  std::vector<LayerGraph> graphs(layers);
  for (int l = 0; l < layers; ++l) {
    // The intermediate tensors live in the context: about 150 KiB per token (75 MB at T = 512).
    ggml_init_params params = {(size_t(64) + size_t(tokens) / 2) << 20, nullptr, false};
    LayerGraph& g = graphs[l];
    g.ctx = ggml_init(params);
    const Weights& w = weight_sets[l % sets];
    g.x = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, kHidden, tokens);
    g.ids = ggml_new_tensor_2d(g.ctx, GGML_TYPE_I32, kTopK, tokens);
    g.route_weights = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, 1, kTopK, tokens);
    ggml_tensor* x = ggml_reshape_3d(g.ctx, g.x, kHidden, 1, tokens);
    ggml_tensor* up = ggml_mul_mat_id(g.ctx, w.up, x, g.ids);
    ggml_tensor* gate = ggml_mul_mat_id(g.ctx, w.gate, x, g.ids);
    ggml_tensor* experts = ggml_mul_mat_id(g.ctx, w.down, ggml_swiglu_split(g.ctx, gate, up), g.ids);
    experts = ggml_mul(g.ctx, experts, g.route_weights);
    ggml_tensor* out = ggml_view_2d(g.ctx, experts, kHidden, tokens, experts->nb[2], 0);
    for (int k = 1; k < kTopK; ++k)
      out = ggml_add(g.ctx, out, ggml_view_2d(g.ctx, experts, kHidden, tokens, experts->nb[2], k * experts->nb[1]));
    g.graph = ggml_new_graph(g.ctx);
    ggml_build_forward_expand(g.graph, out);
    float* xs = static_cast<float*>(g.x->data);
    for (int i = 0; i < kHidden * tokens; ++i) xs[i] = normal(rng) * 50;
  }

  const auto route = [&](LayerGraph& g) {  // K distinct experts per token, equal weights
    int32_t* ids = static_cast<int32_t*>(g.ids->data);
    float* weights = static_cast<float*>(g.route_weights->data);
    std::vector<int> order(kExperts);
    for (int t = 0; t < tokens; ++t) {
      for (int e = 0; e < kExperts; ++e) order[e] = e;
      for (int k = 0; k < kTopK; ++k) {
        std::swap(order[k], order[k + rng() % (kExperts - k)]);
        ids[t * kTopK + k] = order[k];
        weights[t * kTopK + k] = 1.0f / kTopK;
      }
    }
  };
  const auto timed_compute = [&](LayerGraph& g) {
    const auto start = std::chrono::steady_clock::now();
    ggml_backend_graph_compute(backend, g.graph);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  std::vector<int64_t> clear_buffer(size_t(clear_mib) << 17, 1);
  volatile int64_t clear_sink = 0;

  std::vector<double> back_to_back;
  for (int i = 0; i < 20 + steps * layers; ++i) {
    route(graphs[0]);
    const double ms = timed_compute(graphs[0]);
    if (i >= 20) back_to_back.push_back(ms);
  }
  std::vector<double> per_layer;
  for (int step = 0; step <= steps; ++step) {  // step 0 warms up
    double ms = 0;
    for (LayerGraph& g : graphs) {
      int64_t sum = 0;
      for (size_t i = 0; i < clear_buffer.size(); i += 8) sum += clear_buffer[i];  // one load per line
      clear_sink = clear_sink + sum;
      route(g);
      ms += timed_compute(g);
    }
    if (step > 0) per_layer.push_back(ms / layers);
  }
  std::printf("ggml %s%s T=%d: 1-layer %.3f ms; %d layers in turn (%d weight sets%s) %.3f ms per layer; ratio %.2f\n",
              name.c_str(), repacked ? " (CPU_REPACK)" : "", tokens, median(back_to_back), layers, sets,
              clear_mib ? (", " + std::to_string(clear_mib) + " MiB read before each").c_str() : "",
              median(per_layer), median(per_layer) / median(back_to_back));
  return 0;
}
