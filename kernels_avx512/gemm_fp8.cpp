// AVX512 FP8 GEMM without AVX512_BF16 or AVX512_VBMI: E4M3 decoded arithmetically, plain AVX512F
// FMA (fp8_lanes.h). The FP8 paths on vdpbf16ps and on byte lookups are in vdpbf16ps.cpp and
// fp8_vbmi.cpp, the files compiled with those instructions.
#include "fp8_lanes.h"

KT_NAMESPACE_BEGIN
namespace avx512 {

void gemm_fp8_fma(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_fp8_on_widened_rows<decode_fp8_line_exact>(x, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
