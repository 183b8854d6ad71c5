// Which AVX512 paths this CPU runs: the kernel table of the avx512 build, and the base of the amx
// build's.
#include <cstdlib>
#include <cstring>

#include "cpu_features.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

struct Paths {
  bool vdpbf16ps, vpdpbusd, vpermb;
  Kernels kernels;
};

Paths choose() {
  const CpuFeatures cpu = detect_cpu_features();
  Paths p;
  p.vdpbf16ps = cpu.avx512_bf16 && !env_flag("KT_KERNEL_DISABLE_AVX512_BF16");
  p.vpdpbusd = cpu.avx512_vnni && !env_flag("KT_KERNEL_DISABLE_AVX512_VNNI");
  p.vpermb = cpu.avx512_vbmi && !env_flag("KT_KERNEL_DISABLE_AVX512_VBMI");
  p.kernels.bf16 = p.vdpbf16ps ? gemm_bf16_vdpbf16ps : gemm_bf16_fma;
  p.kernels.mxfp4 = p.vpdpbusd ? gemm_mxfp4_vpdpbusd : gemm_mxfp4_maddubs;
  p.kernels.int8 = p.vpdpbusd ? gemm_int8_vpdpbusd : gemm_int8_maddwd;
  p.kernels.int4 = p.vpdpbusd ? gemm_int4_vpdpbusd : gemm_int4_maddubs;
  p.kernels.fp8 = !p.vdpbf16ps ? gemm_fp8_fma : p.vpermb ? gemm_fp8_vdpbf16ps_vbmi : gemm_fp8_vdpbf16ps;
  return p;
}

const Paths& chosen() {
  static const Paths paths = choose();
  return paths;
}

}  // namespace

const Kernels& paths() { return chosen().kernels; }

KernelInfo paths_info() {
  const Paths& p = chosen();
  return {"avx512", p.vdpbf16ps ? "avx512_bf16 (vdpbf16ps)" : "avx512f (bf16->fp32, fma)",
          p.vpdpbusd ? "E2M1 -> integers by vpshufb, int8 activations, avx512_vnni (vpdpbusd)"
                     : "E2M1 -> integers by vpshufb, int8 activations, avx512bw (vpmaddubsw)",
          p.vpdpbusd ? "avx512_vnni (vpdpbusd)" : "avx512bw (vpmaddwd / vpmaddubsw)",
          !p.vdpbf16ps ? "E4M3 -> bf16 arithmetically, fp32 fma"
          : p.vpermb   ? "E4M3 -> bf16 arithmetically (byte lookups, avx512_vbmi, for zero and subnormal codes), vdpbf16ps"
                       : "E4M3 -> bf16 arithmetically, vdpbf16ps"};
}

}  // namespace avx512
KT_NAMESPACE_END
