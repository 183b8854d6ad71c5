// Which AVX512 paths this CPU runs: the kernel table of the avx512 build, and the base of the amx
// build's.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "cpu_features.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

// Whether vdpbf16ps multiplies bf16 faster than fp32 FMA on widened bf16 on this CPU. Not on every
// CPU that has it: on a Xeon under KVM (Emerald Rapids class) vdpbf16ps issues at a quarter of the
// FMA rate, and its BF16 GEMMs took 1.25x (layer, T = 512) to 1.6x (one core, in cache) as long;
// where it issues at the FMA rate, it does twice the work. So the two BF16 GEMMs are timed on the
// same problem in cache (24 rows x 64 outputs x 1024 inputs, about 40 us each), best of five
// alternating runs, at the first call.
bool vdpbf16ps_measures_faster() {
  constexpr int kRows = 24, kGroups = 4, kInputs = 1024;
  AlignedBuffer<bf16_t> x(size_t(kRows) * kInputs), w(size_t(kGroups) * kGroupRows * kInputs);  // the tiles' aligned loads
  AlignedBuffer<float> y(size_t(kRows) * kGroups * kGroupRows);
  AlignedBuffer<uint8_t> scratch(kernel_scratch_bytes(kRows, kInputs));
  std::fill_n(x.data(), x.capacity(), bf16_t(0x3F80));  // 1.0: no denormals on either path
  std::fill_n(w.data(), w.capacity(), bf16_t(0x3F80));
  Activations rows{x.data(), kInputs, nullptr, kRows};
  rows.scratch = scratch.data();
  const PackedGroups weights{reinterpret_cast<const uint8_t*>(w.data()), nullptr, kGroupRows * kInputs * sizeof(bf16_t),
                             0, kInputs, kGroups};
  const GemmFn gemms[2] = {gemm_bf16_vdpbf16ps, gemm_bf16_fma};
  double best[2] = {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  for (int run = 0; run < 6; ++run)  // the first run of each only warms caches and clocks
    for (int path = 0; path < 2; ++path) {
      const auto start = std::chrono::steady_clock::now();
      gemms[path](rows, weights, y.data(), kGroups * kGroupRows);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (run > 0) best[path] = std::min(best[path], took.count());
    }
  return best[0] <= best[1];
}

// Calls of one activation row (decode: every expert's at T = 1, most at T = 8) stay on vdpbf16ps
// where fp32 FMA measured faster: there each weight line takes one vdpbf16ps but a widening and two
// FMAs, and the weights stream from DRAM (Xeon VM, qwen3-30b FP8 T = 1: 1.92-1.99 ms against
// 1.98-2.11 with FMA for every call).
template <GemmFn OneRow, GemmFn Rows>
void one_row_or_rows(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  (x.rows == 1 ? OneRow : Rows)(x, w, y, y_stride);
}

struct Paths {
  bool vdpbf16ps, vpdpbusd, vpermb;
  bool fma_for_rows;  // vdpbf16ps measured slower than fp32 FMA: calls of several rows take FMA
  Kernels kernels;
};

Paths choose() {
  const CpuFeatures cpu = detect_cpu_features();
  Paths p;
  p.vdpbf16ps = cpu.avx512_bf16 && !env_flag("KT_KERNEL_DISABLE_AVX512_BF16");
  p.fma_for_rows = p.vdpbf16ps && !env_flag("KT_KERNEL_FORCE_AVX512_BF16") && !vdpbf16ps_measures_faster();
  p.vpdpbusd = cpu.avx512_vnni && !env_flag("KT_KERNEL_DISABLE_AVX512_VNNI");
  p.vpermb = cpu.avx512_vbmi && !env_flag("KT_KERNEL_DISABLE_AVX512_VBMI");
  if (!p.vdpbf16ps)
    p.kernels.bf16 = gemm_bf16_fma;
  else
    p.kernels.bf16 = p.fma_for_rows ? one_row_or_rows<gemm_bf16_vdpbf16ps, gemm_bf16_fma> : gemm_bf16_vdpbf16ps;
  p.kernels.mxfp4 = p.vpdpbusd ? gemm_mxfp4_vpdpbusd : gemm_mxfp4_maddubs;
  p.kernels.int8 = p.vpdpbusd ? gemm_int8_vpdpbusd : gemm_int8_maddwd;
  p.kernels.int4 = p.vpdpbusd ? gemm_int4_vpdpbusd : gemm_int4_maddubs;
  if (!p.vdpbf16ps)
    p.kernels.fp8 = p.vpermb ? gemm_fp8_fma_vbmi : gemm_fp8_fma;
  else if (!p.fma_for_rows)
    p.kernels.fp8 = p.vpermb ? gemm_fp8_vdpbf16ps_vbmi : gemm_fp8_vdpbf16ps;
  else  // the FMA GEMM's few-row tiles decode faster than vdpbf16ps's (fp8_lanes.h)
    p.kernels.fp8 = p.vpermb ? gemm_fp8_fma_vbmi : gemm_fp8_fma;
  return p;
}

const char* fp8_path(const Paths& p) {
  if (p.fma_for_rows)
    return p.vpermb ? "E4M3 -> fp32 arithmetically (byte lookups, avx512_vbmi, for zero and subnormal codes), fp32 fma "
                      "(measured faster than avx512_bf16 here)"
                    : "E4M3 -> fp32 arithmetically, fp32 fma (measured faster than avx512_bf16 here)";
  if (p.vpermb)
    return p.vdpbf16ps ? "E4M3 -> bf16 arithmetically (byte lookups, avx512_vbmi, for zero and subnormal codes), vdpbf16ps"
                       : "E4M3 -> fp32 arithmetically (byte lookups, avx512_vbmi, for zero and subnormal codes), fp32 fma";
  return p.vdpbf16ps ? "E4M3 -> bf16 arithmetically, vdpbf16ps" : "E4M3 -> fp32 arithmetically, fp32 fma";
}

const Paths& chosen() {
  static const Paths paths = choose();
  return paths;
}

}  // namespace

const Kernels& paths() { return chosen().kernels; }

KernelInfo paths_info() {
  const Paths& p = chosen();
  const char* bf16 = p.fma_for_rows
                         ? "avx512f (bf16->fp32, fma: measured faster than avx512_bf16 here), avx512_bf16 for one-row calls"
                     : p.vdpbf16ps ? "avx512_bf16 (vdpbf16ps)"
                                   : "avx512f (bf16->fp32, fma)";
  return {"avx512", bf16,
          p.vpdpbusd ? "E2M1 -> integers by vpshufb, int8 activations, avx512_vnni (vpdpbusd)"
                     : "E2M1 -> integers by vpshufb, int8 activations, avx512bw (vpmaddubsw)",
          p.vpdpbusd ? "avx512_vnni (vpdpbusd)" : "avx512bw (vpmaddwd / vpmaddubsw)",
          fp8_path(p)};
}

}  // namespace avx512
KT_NAMESPACE_END
