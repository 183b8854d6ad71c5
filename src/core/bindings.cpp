// The Python module of one variant. Compiled WITHOUT the variant's ISA flags: the first thing the
// module does is check (CPUID) that the CPU can run the rest, and refuse to load otherwise.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cctype>
#include <stdexcept>

#include "cpu_features.h"
#include "engine.h"
#include "linear.h"
#include "formats.h"
#include "formats/gguf_levels.h"
#include "kernels.h"
#include "machine_probe.h"
#include "packed_file.h"
#include "subpools.h"

namespace nb = nanobind;
using kt::bf16_t;

void bind_stream_calls(nb::module_& m);  // bindings_stream.cpp
void bind_load_helpers(nb::module_& m);  // bindings_load.cpp

// bf16 tensors cross as int16 views (DLPack has bf16, but one integer type keeps this simple).
template <typename T, typename... Shape>
using CpuArray = nb::ndarray<T, nb::c_contig, nb::device::cpu, Shape...>;
using Bf16In3 = CpuArray<const int16_t, nb::ndim<3>>;
using Bf16In2 = CpuArray<const int16_t, nb::ndim<2>>;
using Bf16Out2 = CpuArray<int16_t, nb::ndim<2>>;
using Float32Out2 = CpuArray<float, nb::ndim<2>>;
// Weights and scales in a format's canonical layout, of any element type (bf16, int8, uint8,
// float32): their sizes in bytes are checked against the format's traits.
template <int Dims>
using Canonical = nb::ndarray<nb::c_contig, nb::device::cpu, nb::ndim<Dims>>;

namespace {

void require(bool condition, const char* message) {
  if (!condition) throw std::invalid_argument(message);
}

const bf16_t* bf16_data(const int16_t* p) { return reinterpret_cast<const bf16_t*>(p); }

// Checks one canonical matrix stack (values [..., rows, bytes], scales [..., rows, count] or none;
// Dims - 2 leading dimensions of `matrices` in all) against `format` for `rows` x `k` weights and
// returns it as a SourceProjection. `what` names it in errors.
template <int Dims>
kt::SourceProjection canonical_source(const kt::FormatTraits& format, const Canonical<Dims>& values,
                                      const std::optional<Canonical<Dims>>& scales, size_t matrices, int rows, int k,
                                      const std::string& what) {
  auto leading = [&](const auto& a) { return Dims == 2 || a.shape(0) == matrices; };
  const size_t row_bytes = values.shape(Dims - 1) * values.itemsize();
  if (!leading(values) || values.shape(Dims - 2) != size_t(rows) || row_bytes != format.row_bytes(k))
    throw std::invalid_argument(what + ": " + format.name + " values must be " + std::to_string(rows) + " rows of " +
                                std::to_string(format.row_bytes(k)) + " bytes per matrix");
  if (!format.has_scales()) {
    require(!scales.has_value(), "this format takes no scales");
    return {values.data(), nullptr, 0};
  }
  if (!scales || !leading(*scales) || scales->shape(Dims - 2) != size_t(rows) ||
      scales->itemsize() != format.scale_bytes())
    throw std::invalid_argument(what + ": " + format.name + " needs scales of " + std::to_string(format.scale_bytes()) +
                                " bytes each, " + std::to_string(rows) + " rows per matrix");
  const int group = kt::scale_group_of(format, k, scales->shape(Dims - 1), what + " scales");
  return {values.data(), scales->data(), group};
}

// canonical_source with the optional zero points (int8, shaped like the scales) of `format`.
template <size_t Dims>
kt::SourceProjection canonical_source(const kt::FormatTraits& format, const Canonical<Dims>& values,
                                      const std::optional<Canonical<Dims>>& scales,
                                      const std::optional<CpuArray<const int8_t, nb::ndim<Dims>>>& zeros,
                                      size_t matrices, int rows, int k, const std::string& what) {
  kt::SourceProjection source = canonical_source<Dims>(format, values, scales, matrices, rows, k, what);
  if (!zeros) return source;
  require(format.has_zero_points(), (std::string(format.name) + " takes no zero points").c_str());
  for (size_t d = 0; d < Dims; ++d)
    require(zeros->shape(d) == scales->shape(d), (what + ": the zero points must have the scales' shape").c_str());
  require(source.scale_group > 0, (what + ": zero points need scales per group of inputs").c_str());
  source.zeros = zeros->data();
  return source;
}

// submit() of MoEEngine or MoESubpools: shapes checked here, the rest by the engine.
template <typename Engine>
void submit(Engine& engine, Bf16In2 hidden, CpuArray<const int64_t, nb::ndim<2>> ids,
            CpuArray<const float, nb::ndim<2>> weights, Bf16Out2 out) {
  require(ids.shape(0) == hidden.shape(0) && weights.shape(0) == hidden.shape(0) && ids.shape(1) == weights.shape(1) &&
              out.shape(0) == hidden.shape(0) && out.shape(1) == hidden.shape(1),
          "hidden, ids, weights and out disagree in shape");
  engine.submit(bf16_data(hidden.data()), int(hidden.shape(0)), ids.data(), weights.data(),
                reinterpret_cast<bf16_t*>(out.data()));
}

// submit() from data addresses, for the Python wrapper, which has checked the tensors: hidden and
// out bf16 [tokens, hidden], ids int64 and weights float32 [tokens, top_k], all contiguous. It
// skips the DLPack exchange of four torch tensors (about 10 us, half of a tiny call). gpu_mask, if
// not 0, is the address of num_experts bools given to set_gpu_experts first (a memcmp when unchanged).
template <typename Engine>
void submit_addresses(Engine& engine, uintptr_t hidden, int tokens, uintptr_t ids, uintptr_t weights, uintptr_t out,
                      uintptr_t gpu_mask) {
  require(tokens >= 1 && hidden && ids && weights && out, "submit_addresses needs tokens >= 1 and non-null addresses");
  if (gpu_mask) engine.set_gpu_experts(reinterpret_cast<const uint8_t*>(gpu_mask));
  engine.submit(reinterpret_cast<const bf16_t*>(hidden), tokens, reinterpret_cast<const int64_t*>(ids),
                reinterpret_cast<const float*>(weights), reinterpret_cast<bf16_t*>(out));
}

kt::Projection parse_projection(const std::string& name) {
  if (name == "gate") return kt::Projection::kGate;
  if (name == "up") return kt::Projection::kUp;
  if (name == "down") return kt::Projection::kDown;
  throw std::invalid_argument("projection must be gate, up or down, not " + name);
}

constexpr const char* kSubmitAddressesDoc =
    "submit() from the tensors' data_ptr()s, unchecked: for callers that checked the tensors. gpu_mask: "
    "the address of num_experts bools (True: computed on the GPU, skipped here), or 0 to keep the set.";

// What this build is and runs: its name, its kernels, the formats' constants (FormatTraits) and
// every build's CPU flags, for the Python side to read rather than restate.
void bind_build_facts(nb::module_& m) {
  m.attr("VARIANT") = KT_VARIANT_NAME;
  m.attr("MAX_DIMENSION") = kt::kMaxDimension;
  m.attr("PACKED_FILE_VERSION") = kt::kPackedFileVersion;

  m.def("kernel_info", [] {
    const kt::KernelInfo info = kt::kernel_info();
    nb::dict d;
    d["variant"] = KT_VARIANT_NAME;
    d["kernels"] = info.isa;
    for (const kt::FormatTraits* format : kt::all_formats()) {
      std::string key = format->name;
      for (char& c : key) c = char(std::tolower(static_cast<unsigned char>(c)));
      d[(key + "_path").c_str()] = info.*(format->path);  // never null: require_kernels_for_every_format
    }
    if (info.emulated_tile_products >= 0) d["emulated_tile_products"] = info.emulated_tile_products;
    return d;
  }, "Which kernels this build runs on this CPU.");

  // The formats' constants, for the Python registry: one definition, here (FormatTraits).
  nb::dict formats;
  for (const kt::FormatTraits* format : kt::all_formats()) {
    nb::dict f;
    f["value_bits"] = format->value_bits;
    f["scale_bytes"] = format->scale_bytes();
    nb::list groups;  // 0: one scale per row
    for (int group : format->allowed_scale_groups()) groups.append(group);
    f["scale_groups"] = nb::tuple(groups);
    f["k_multiple"] = format->k_multiple;
    f["max_k"] = format->max_k;
    f["quantized_activations"] = format->quantized_activations();
    f["zero_points"] = format->has_zero_points();
    f["scales_per_group"] = format->scales_per_group;
    formats[format->name] = f;
  }
  m.attr("FORMATS") = formats;
  m.attr("GROUP_ROWS") = kt::kGroupRows;
  m.attr("FP8_BLOCK") = kt::kFp8Block;  // DeepSeek's 128 x 128 scale blocks (kernels.h), for formats.py
  nb::list level_sets;  // the GGUF level sets (formats/gguf_levels.h), held against gguf_blocks.py
  for (const auto& set : kt::kLevelSets) {
    nb::list levels;
    for (int8_t level : set) levels.append(int(level));
    level_sets.append(levels);
  }
  m.attr("GGUF_LEVEL_SETS") = level_sets;

  nb::dict requirements;  // every build's CPU flags, as the module checks them (cpu_features.h)
  for (const auto& [build, flags] : kt::build_requirements()) {
    nb::list names;
    for (const std::string& flag : flags) names.append(flag);
    requirements[build.c_str()] = nb::tuple(names);
  }
  m.attr("BUILD_REQUIREMENTS") = requirements;

  m.def("cpu_features", [] {
    const kt::CpuFeatures f = kt::detect_cpu_features();
    nb::dict d;
    for (const kt::CpuFlag& flag : kt::kBuildFlags) d[flag.name] = f.*flag.present;
    return d;
  }, "The flags the builds require, as CPUID/XGETBV report them.");
}

// The machine's limits, for the benchmark (machine_probe.h).
void bind_machine_probes(nb::module_& m) {
  m.def("measure_read_bandwidth", &kt::measure_read_bandwidth, nb::arg("threads"), nb::arg("bytes"),
        nb::arg("repeats") = 5, nb::call_guard<nb::gil_scoped_release>(),
        "Median DRAM read bandwidth (GB/s) of a streaming read on `threads` threads.");
  m.def("measure_peak_gflops",
        [](int threads, const std::string& op) {
          if (op == "fma_f32") return kt::measure_peak_gflops(threads, kt::PeakOp::kFmaF32);
          if (op == "dpbf16") return kt::measure_peak_gflops(threads, kt::PeakOp::kDpBf16);
          if (op == "dpint8") return kt::measure_peak_gflops(threads, kt::PeakOp::kDpInt8);
          if (op == "tile_bf16") return kt::measure_peak_gflops(threads, kt::PeakOp::kTileBf16);
          throw std::invalid_argument("op must be fma_f32, dpbf16, dpint8 or tile_bf16");
        },
        nb::arg("threads"), nb::arg("op"), nb::call_guard<nb::gil_scoped_release>(),
        "Peak GFLOP/s (GOP/s) of fp32 FMA ('fma_f32'), vdpbf16ps ('dpbf16'), vpdpbusd ('dpint8') or AMX "
        "tdpbf16ps ('tile_bf16'); 0 where this build/CPU lacks it (and for tiles on the emulated build).");
}

// One GEMM without the MoE (linear.h): a testing and profiling aid.
void bind_linear(nb::module_& m) {
  m.def("linear",
        [](const std::string& method, Bf16In2 x, Canonical<2> weight, std::optional<Canonical<2>> scale, Float32Out2 y,
           int repeats, bool int8_activations, std::optional<CpuArray<const int8_t, nb::ndim<2>>> zeros) {
          const kt::FormatTraits& format = kt::format_named(method);
          const int m = int(x.shape(0)), k = int(x.shape(1)), n = int(y.shape(1));
          require(y.shape(0) == x.shape(0), "x and y disagree in shape");
          require(k % format.k_multiple == 0 && k <= format.max_k, "k does not suit this format");
          const kt::SourceProjection w = canonical_source<2>(format, weight, scale, zeros, 1, n, k, "weight");
          require(repeats >= 1, "repeats must be >= 1");
          nb::gil_scoped_release release;
          return kt::linear(format, bf16_data(x.data()), m, k, w, n, y.data(), repeats, int8_activations);
        },
        nb::arg("method"), nb::arg("x"), nb::arg("weight"), nb::arg("scale").none(), nb::arg("y"),
        nb::arg("repeats") = 1, nb::arg("int8_activations") = false, nb::arg("zeros").none() = nb::none(),
        "y = x @ weight.T by the kernel on this thread (weight in canonical layout, INT4 optionally with "
        "int8 zero points shaped like its scales); returns the mean "
        "seconds of one GEMM over `repeats` runs (packing excluded). A testing and profiling aid.");
}

// One engine with a thread pool of its own (engine.h).
void bind_engine(nb::module_& m) {
  nb::class_<kt::MoEEngine>(m, "MoEEngine")
      .def("__init__",
           [](kt::MoEEngine* self, int num_experts, int top_k, int hidden, int intermediate, const std::string& method,
              int threads, const std::vector<int>& skip_experts) {
             require(threads >= 1, "threads must be >= 1");
             new (self) kt::MoEEngine({num_experts, top_k, hidden, intermediate}, kt::format_named(method),
                                      std::make_shared<kt::ThreadPool>(threads), skip_experts);
           },
           nb::arg("num_experts"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("method"),
           nb::arg("threads"), nb::arg("skip_experts"), "An engine with a thread pool of its own (for tests).")
      .def("load",
           [](kt::MoEEngine& engine, Canonical<3> gate, std::optional<Canonical<3>> gate_scale, Canonical<3> up,
              std::optional<Canonical<3>> up_scale, Canonical<3> down, std::optional<Canonical<3>> down_scale,
              CpuArray<const int64_t, nb::ndim<1>> source_of_slot, std::optional<CpuArray<const int8_t, nb::ndim<3>>> gate_zeros,
              std::optional<CpuArray<const int8_t, nb::ndim<3>>> up_zeros,
              std::optional<CpuArray<const int8_t, nb::ndim<3>>> down_zeros) {
             const kt::MoEShape& shape = engine.shape();
             const kt::FormatTraits& format = engine.format();
             const size_t sources = gate.shape(0);
             require(source_of_slot.shape(0) == size_t(shape.num_experts), "source_of_slot needs one entry per expert");
             const int H = shape.hidden, I = shape.intermediate;
             const kt::SourceProjection g = canonical_source<3>(format, gate, gate_scale, gate_zeros, sources, I, H, "gate");
             const kt::SourceProjection u = canonical_source<3>(format, up, up_scale, up_zeros, sources, I, H, "up");
             const kt::SourceProjection d = canonical_source<3>(format, down, down_scale, down_zeros, sources, H, I, "down");
             nb::gil_scoped_release release;
             engine.load(g, u, d, int(sources), source_of_slot.data());
           },
           nb::arg("gate"), nb::arg("gate_scale").none(), nb::arg("up"), nb::arg("up_scale").none(), nb::arg("down"),
           nb::arg("down_scale").none(), nb::arg("source_of_slot"), nb::arg("gate_zeros").none() = nb::none(),
           nb::arg("up_zeros").none() = nb::none(), nb::arg("down_zeros").none() = nb::none(),
           "Copy and pack the weights of the source expert of every slot (source_of_slot[slot]; -1: the slot "
           "keeps what an earlier call packed, see unload) in the engine's format's canonical layout: "
           "gate/up [E, I, row bytes of H], down [E, H, row bytes of I], scales [E, rows, scales per row] or None "
           "(any element type; sizes checked in bytes); INT4 also takes int8 zero points shaped like its scales "
           "(weights (q - zero) * scale).")
      .def("set_biases",
           [](kt::MoEEngine& engine, std::optional<CpuArray<const float, nb::ndim<2>>> gate,
              std::optional<CpuArray<const float, nb::ndim<2>>> up,
              std::optional<CpuArray<const float, nb::ndim<2>>> down) {
             const kt::MoEShape& shape = engine.shape();
             auto checked = [&](const auto& bias, int rows, const char* message) -> const float* {
               if (!bias) return nullptr;
               require(bias->shape(0) == size_t(shape.num_experts) && bias->shape(1) == size_t(rows), message);
               return bias->data();
             };
             const float* g = checked(gate, shape.intermediate, "gate bias must be float32 [num_experts, intermediate]");
             const float* u = checked(up, shape.intermediate, "up bias must be float32 [num_experts, intermediate]");
             const float* d = checked(down, shape.hidden, "down bias must be float32 [num_experts, hidden]");
             nb::gil_scoped_release release;
             engine.set_biases(g, u, d);
           },
           nb::arg("gate").none(), nb::arg("up").none(), nb::arg("down").none(),
           "Expert biases per slot (float32, C-contiguous, each None or: gate/up [E, I], down [E, H]), added "
           "in fp32: gate and up before the activation, down before the routing weight. All None: none.")
      .def("packed_bytes", &kt::MoEEngine::packed_bytes, "Bytes of the packed weights.")
      .def("save_packed",
           [](kt::MoEEngine& engine, const std::string& path, nb::bytes meta) {
             const std::string bytes(meta.c_str(), meta.size());
             nb::gil_scoped_release release;
             engine.save_packed(path, bytes);
           },
           nb::arg("path"), nb::arg("meta"),
           "Write the loaded weights (packed, with the packed mask and biases) and `meta` to the new file `path` "
           "(it must not exist), synced; RuntimeError naming the path where a write fails (the file removed).")
      .def("map_packed",
           [](kt::MoEEngine& engine, const std::string& path, bool verify_content) {
             std::string meta, reason;
             {
               nb::gil_scoped_release release;
               reason = engine.map_packed(path, verify_content, &meta);
             }
             return nb::make_tuple(reason, nb::bytes(meta.data(), meta.size()));
           },
           nb::arg("path"), nb::arg("verify_content") = false,
           "Map a file save_packed wrote in place of loading: ('', its meta bytes), or (why it cannot be "
           "used, b'') with the weights as they were. verify_content: check the weights' checksum too.")
      .def_prop_ro("mapped", &kt::MoEEngine::mapped, "Whether the weights are views of a mapped file.")
      .def("biases",
           [](const kt::MoEEngine& engine, const std::string& projection, CpuArray<float, nb::ndim<2>> out) {
             const kt::Projection p = parse_projection(projection);
             const kt::MoEShape& shape = engine.shape();
             const int rows = p == kt::Projection::kDown ? shape.hidden : shape.intermediate;
             require(out.shape(0) == size_t(shape.num_experts) && out.shape(1) == size_t(rows),
                     "biases: out must be float32 [num_experts, rows of the projection]");
             return engine.biases(p, out.data());
           },
           nb::arg("projection"), nb::arg("out"),
           "Each slot's biases of 'gate', 'up' or 'down' into out; False (out untouched) where there are none.")
      .def("unload", &kt::MoEEngine::unload, nb::call_guard<nb::gil_scoped_release>(),
           "Mark every slot unpacked (memory kept): a load in parts, with source_of_slot -1 for the slots "
           "another part packs, starts here; the engine runs once every slot is packed.")
      .def("submit", &submit<kt::MoEEngine>, nb::call_guard<nb::gil_scoped_release>(),
           "Start a forward; hidden and out must stay alive until sync().")
      .def("submit_addresses", &submit_addresses<kt::MoEEngine>, nb::arg("hidden"), nb::arg("tokens"), nb::arg("ids"),
           nb::arg("weights"), nb::arg("out"), nb::arg("gpu_mask") = 0, nb::call_guard<nb::gil_scoped_release>(),
           kSubmitAddressesDoc)
      .def("unpack",
           [](kt::MoEEngine& engine, const std::string& projection, int expert, int row0, int rows, int k0, int cols,
              uintptr_t values, size_t values_stride, uintptr_t scales, size_t scales_stride) {
             kt::UnpackRegion region;
             region.row0 = row0, region.rows = rows, region.k0 = k0, region.cols = cols;
             region.values = reinterpret_cast<uint8_t*>(values), region.values_stride = values_stride;
             region.scales = reinterpret_cast<uint8_t*>(scales), region.scales_stride = scales_stride;
             nb::gil_scoped_release release;
             engine.unpack(parse_projection(projection), expert, region);
           },
           nb::arg("projection"), nb::arg("expert"), nb::arg("row0"), nb::arg("rows"), nb::arg("k0"), nb::arg("cols"),
           nb::arg("values"), nb::arg("values_stride"), nb::arg("scales"), nb::arg("scales_stride"),
           "Write slot `expert`'s rows [row0, row0 + rows) and inputs [k0, k0 + cols) of projection 'gate', 'up' or "
           "'down' in the canonical layout to the addresses given (row strides in bytes), unchecked beyond the "
           "projection's bounds.")
      .def("sync", &kt::MoEEngine::sync, nb::call_guard<nb::gil_scoped_release>())
      .def("release_scratch", &kt::MoEEngine::release_scratch)
      .def("worker_cpus", &kt::MoEEngine::worker_cpus, nb::call_guard<nb::gil_scoped_release>(),
           "The CPUs each worker thread may run on, as the kernel reports them to the thread itself.")
      .def_prop_ro("pending", &kt::MoEEngine::pending);
}

// The process's worker pools and a layer split into subpools across them (subpools.h).
void bind_subpools(nb::module_& m) {
  nb::class_<kt::WorkerPools>(m, "WorkerPools", nb::is_weak_referenceable())
      .def(nb::init<const std::vector<int>&, const std::vector<std::vector<int>>&>(), nb::arg("threads"),
           nb::arg("cpus"),
           "The process's worker threads, shared by every layer: subpool i gets threads[i] threads pinned to "
           "cpus[i] (empty: not pinned).")
      .def("__len__", &kt::WorkerPools::size);

  nb::class_<kt::MoESubpools>(m, "MoESubpools")
      .def("__init__",
           [](kt::MoESubpools* self, int num_experts, int top_k, int hidden, const std::string& method,
              const kt::WorkerPools& pools, const std::vector<int>& intermediates,
              const std::vector<int>& skip_experts, bool int8_activations, float swiglu_limit, float swiglu_alpha) {
             int intermediate = 0;
             for (int slice : intermediates) intermediate += slice;
             kt::EngineOptions options;
             options.int8_activations = int8_activations;
             options.swiglu_limit = swiglu_limit;
             options.swiglu_alpha = swiglu_alpha;
             new (self) kt::MoESubpools({num_experts, top_k, hidden, intermediate}, kt::format_named(method), pools,
                                        intermediates, skip_experts, options);
           },
           nb::arg("num_experts"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("method"), nb::arg("pools"),
           nb::arg("intermediates"), nb::arg("skip_experts"), nb::arg("int8_activations") = false,
           nb::arg("swiglu_limit") = 0.0f, nb::arg("swiglu_alpha") = 0.0f,
           "Subpool i: an engine of intermediates[i] rows of I (consecutive slices) on pools' subpool i.")
      .def("__len__", &kt::MoESubpools::size)
      .def("twin", &kt::MoESubpools::twin,
           "Subpools on the same weights, mask and threads with call state of their own: a second call of "
           "this layer in flight (deferred experts).")
      .def("engine", &kt::MoESubpools::engine, nb::rv_policy::reference_internal,
           "Subpool i's engine, to load its slice of the weights.")
      .def("submit", &submit<kt::MoESubpools>, nb::call_guard<nb::gil_scoped_release>(),
           "Start a forward on every subpool; hidden and out must stay alive until sync().")
      .def("submit_addresses", &submit_addresses<kt::MoESubpools>, nb::arg("hidden"), nb::arg("tokens"),
           nb::arg("ids"), nb::arg("weights"), nb::arg("out"), nb::arg("gpu_mask") = 0,
           nb::call_guard<nb::gil_scoped_release>(), kSubmitAddressesDoc)
      .def("sync", &kt::MoESubpools::sync, nb::call_guard<nb::gil_scoped_release>(),
           "Wait for every subpool, then sum their partial outputs into out.")
      .def("release_scratch", &kt::MoESubpools::release_scratch)
      .def_prop_ro("pending", &kt::MoESubpools::pending);
}

}  // namespace

NB_MODULE(KT_MODULE_NAME, m) {
  kt::require_cpu_support(KT_CPU_CHECK);  // throws -> ImportError, before any ISA code runs
  kt::init_kernels();
  kt::require_kernels_for_every_format();  // a build without a format's kernel: ImportError, not INT8's

  m.doc() = "kt_kernel compiled kernels, " KT_VARIANT_NAME " build";
  bind_build_facts(m);
  bind_machine_probes(m);
  bind_linear(m);
  bind_engine(m);
  bind_subpools(m);
  bind_stream_calls(m);
  bind_load_helpers(m);
}
