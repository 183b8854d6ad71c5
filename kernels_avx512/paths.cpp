// Which AVX512 paths this CPU runs: the kernel table of the avx512 build, and the base of the amx
// build's.

#include "cpu_features.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// Whether fp32 FMA on widened bf16 multiplies faster than vdpbf16ps in calls of several rows: on
// Intel CPUs. On a Xeon VM of the Emerald Rapids class vdpbf16ps issues at a quarter of the FMA
// rate, so it does half FMA's work per second, and its BF16 GEMMs took 1.25x (layer, T = 512) to
// 1.6x (one core, in cache) as long. Other CPUs keep vdpbf16ps (the Zen 4 VM's figures were
// measured with it). A CPUID rule, not a timing: timing both at the first call chose differently in
// 2 of 8 processes pinned to one CPU with four workers, and the two paths round differently, so the
// same input gave two results.
bool fma_beats_vdpbf16ps(const CpuFeatures& cpu) { return cpu.intel; }

// BF16 calls of one activation row (decode: every expert's at T = 1, most at T = 8) stay on
// vdpbf16ps where fp32 FMA is faster for several: there each weight line takes one vdpbf16ps but a
// widening and two FMAs, and the weights stream from DRAM (Xeon VM, one core: the FMA tile 2-7 %
// slower). FP8's FMA tiles of few rows decode in place and are the faster (fp8_lanes.h).
template <GemmFn OneRow, GemmFn Rows>
void one_row_or_rows(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  (x.rows == 1 ? OneRow : Rows)(x, w, y, y_stride);
}

struct Paths {
  bool vdpbf16ps, vpdpbusd, vpermb;
  bool fma_for_rows;  // fp32 FMA beats vdpbf16ps here: calls of several rows take it
  Kernels kernels;
};

Paths choose() {
  const CpuFeatures cpu = detect_cpu_features();
  Paths p;
  p.vdpbf16ps = cpu.avx512_bf16 && !env_flag("KT_KERNEL_DISABLE_AVX512_BF16");
  p.fma_for_rows = p.vdpbf16ps && !env_flag("KT_KERNEL_FORCE_AVX512_BF16") && fma_beats_vdpbf16ps(cpu);
  p.vpdpbusd = cpu.avx512_vnni && !env_flag("KT_KERNEL_DISABLE_AVX512_VNNI");
  p.vpermb = cpu.avx512_vbmi && !env_flag("KT_KERNEL_DISABLE_AVX512_VBMI");
  p.kernels.peak = peak_probe;
  if (!p.vdpbf16ps)
    p.kernels.bf16 = gemm_bf16_fma;
  else
    p.kernels.bf16 = p.fma_for_rows ? one_row_or_rows<gemm_bf16_vdpbf16ps, gemm_bf16_fma> : gemm_bf16_vdpbf16ps;
  if (p.vpdpbusd)
    p.kernels.mxfp4 = p.vpermb ? gemm_mxfp4_vpdpbusd_vbmi : gemm_mxfp4_vpdpbusd;
  else
    p.kernels.mxfp4 = gemm_mxfp4_maddubs;
  p.kernels.int8 = p.vpdpbusd ? gemm_int8_vpdpbusd : gemm_int8_maddwd;
  p.kernels.int4 = p.vpdpbusd ? gemm_int4_vpdpbusd : gemm_int4_maddubs;
  p.kernels.gguf = p.vpdpbusd ? gemm_gguf_vpdpbusd : gemm_gguf_maddwd;
  if (p.vdpbf16ps && !p.fma_for_rows)
    p.kernels.fp8 = p.vpermb ? gemm_fp8_vdpbf16ps_vbmi : gemm_fp8_vdpbf16ps;
  else
    p.kernels.fp8 = p.vpermb ? gemm_fp8_fma_vbmi : gemm_fp8_fma;
  return p;
}

const char* fp8_path(const Paths& p) {
  if (p.fma_for_rows)
    return p.vpermb ? "E4M3 -> fp32 (up to 4 rows) or bf16 arithmetically (byte lookups, avx512_vbmi, for zero and "
                      "subnormal codes), fp32 fma (faster than avx512_bf16 on Intel CPUs)"
                    : "E4M3 -> fp32 (up to 4 rows) or bf16 arithmetically, fp32 fma (faster than avx512_bf16 on Intel CPUs)";
  if (p.vpermb)
    return p.vdpbf16ps ? "E4M3 -> bf16 arithmetically (byte lookups, avx512_vbmi, for zero and subnormal codes), vdpbf16ps"
                       : "E4M3 -> fp32 (up to 4 rows) or bf16 arithmetically (byte lookups, avx512_vbmi, for zero and "
                         "subnormal codes), fp32 fma";
  return p.vdpbf16ps ? "E4M3 -> bf16 arithmetically, vdpbf16ps"
                     : "E4M3 -> fp32 (up to 4 rows) or bf16 arithmetically, fp32 fma";
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
                         ? "avx512f (bf16->fp32, fma: faster than avx512_bf16 on Intel CPUs), avx512_bf16 for one-row calls"
                     : p.vdpbf16ps ? "avx512_bf16 (vdpbf16ps)"
                                   : "avx512f (bf16->fp32, fma)";
  // GGUF's int8 values are multiplied as INT8's (int_tiles.h).
  const char* int8 = p.vpdpbusd ? "avx512_vnni (vpdpbusd)" : "avx512bw (vpmaddwd on int16 activations)";
  const char* gguf = p.vpdpbusd ? int8
                                : "avx512bw (vpmaddwd on int16 activations; nibbles of 16 consecutive levels: "
                                  "vpmaddubsw on int8 rows for one token or int8_activations)";
  return {.isa = "avx512",
          .bf16_path = bf16,
          .mxfp4_path = !p.vpdpbusd ? "E2M1 -> integers by vpshufb, avx512bw (vpmaddwd on a row and its residual "
                                      "as int16, vpmaddubsw on int8 rows for one token or int8_activations)"
                        : p.vpermb  ? "E2M1 -> integers by vpermb (avx512_vbmi), int8 rows, avx512_vnni (vpdpbusd)"
                                    : "E2M1 -> integers by vpshufb, int8 rows, avx512_vnni (vpdpbusd)",
          .int8_path = int8,
          .fp8_path = fp8_path(p),
          .gguf_path = gguf};
}

}  // namespace avx512
KT_NAMESPACE_END
