// The avx2 build's kernel interface (kernels.h): one path per format, nothing to choose.
#include "vec.h"

KT_NAMESPACE_BEGIN

const Kernels& kernels() {
  static constexpr Kernels table = {avx2::gemm_bf16, avx2::gemm_mxfp4, avx2::gemm_int8, avx2::gemm_int4,
                                    avx2::gemm_fp8, avx2::peak_probe};
  return table;
}

void init_kernels() {}

KernelInfo kernel_info() {
  return {"avx2", "avx2 (bf16->fp32, fma)",
          "avx2 (E2M1 -> integers by vpshufb; vpmaddwd on a row and its residual as int16, vpmaddubsw on int8 "
          "rows for one token or int8_activations)",
          "avx2 (vpmaddwd on int16 activations)",
          "avx2 (up to five rows of normal codes: E4M3 -> bf16 bytes by a nibble lookup; else one or two rows: E4M3 -> fp16 "
          "by shifts, F16C to fp32; more rows: E4M3 -> bf16 arithmetically; fp32 fma)"};
}

KT_NAMESPACE_END
