// The avx2 build's kernel interface (kernels.h): one path per format, and vpdpbusd (AVX-VNNI) for
// the integer formats where CPUID reports it and KT_KERNEL_DISABLE_AVX_VNNI=1 does not forbid it
// (the tests cover both paths on one machine).
#include "cpu_features.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace {

bool avx_vnni() {
  static const bool on = detect_cpu_features().avx_vnni && !env_flag("KT_KERNEL_DISABLE_AVX_VNNI");
  return on;
}

double peak_probe_here(PeakOp op, int64_t iterations) {
  if (op == PeakOp::kDpInt8) return avx_vnni() ? avx2::dpbusd_avx_peak_probe(iterations) : 0.0;
  return avx2::peak_probe(op, iterations);
}

Kernels choose() {
  if (avx_vnni())
    return {.bf16 = avx2::gemm_bf16,
            .mxfp4 = avx2::gemm_mxfp4_avx_vnni,
            .int8 = avx2::gemm_int8_avx_vnni,
            .int4 = avx2::gemm_int4_avx_vnni,
            .fp8 = avx2::gemm_fp8,
            .gguf = avx2::gemm_gguf_avx_vnni,
            .peak = peak_probe_here};
  return {.bf16 = avx2::gemm_bf16,
          .mxfp4 = avx2::gemm_mxfp4,
          .int8 = avx2::gemm_int8,
          .int4 = avx2::gemm_int4,
          .fp8 = avx2::gemm_fp8,
          .gguf = avx2::gemm_gguf,
          .peak = peak_probe_here};
}

}  // namespace

const Kernels& kernels() {
  static const Kernels table = choose();
  return table;
}

void init_kernels() { kernels(); }

KernelInfo kernel_info() {
  const char* fp8 =
      "avx2 (up to five rows of normal codes: E4M3 -> bf16 bytes by a nibble lookup; else one or two rows: E4M3 -> "
      "fp16 by shifts, F16C to fp32; more rows: E4M3 -> bf16 arithmetically; fp32 fma)";
  const char* int8 = avx_vnni() ? "avx2 avx_vnni (vpdpbusd)" : "avx2 (vpmaddwd on int16 activations)";
  // GGUF's values are multiplied as INT8's, nibbles of 16 consecutive levels as INT4's (int_tiles.h);
  // up to 4 tokens of Q4_K or 2 of Q6_K by a one-token tile of its own (gemm_one_token.cpp).
  const char* gguf = avx_vnni() ? int8
                                : "avx2 (vpmaddwd on int16 activations; nibbles of 16 consecutive levels: "
                                  "vpmaddubsw on int8 rows for one token or int8_activations; up to 4 tokens "
                                  "of Q4_K, 2 of Q6_K: a token at a time, vpmaddubsw widened by the scale's "
                                  "integer multiple)";
  return {.isa = "avx2",
          .bf16_path = "avx2 (bf16->fp32, fma)",
          .mxfp4_path = avx_vnni() ? "avx2 (E2M1 -> integers by vpshufb, int8 rows, avx_vnni (vpdpbusd))"
                                   : "avx2 (E2M1 -> integers by vpshufb; vpmaddwd on a row and its residual as "
                                     "int16, vpmaddubsw on int8 rows for one token or int8_activations)",
          .int8_path = int8,
          .fp8_path = fp8,
          .gguf_path = gguf};
}

KT_NAMESPACE_END
