// AVX512 MXFP4 GEMM: the vdpbf16ps path where the CPU has AVX512_BF16 (vdpbf16ps.cpp), else the
// plain AVX512F path here (bf16 -> fp32, FMA). The tile itself is mxfp4_tile.h.
#include "mxfp4_tile.h"

KT_NAMESPACE_BEGIN
namespace {

constexpr int kFmaRows = 4;

struct FmaDot {
  static void accumulate(__m512& sum, const bf16_t* x_pair, __m512i w) {
    const __m512i xv = _mm512_set1_epi32(load_bf16_pair(x_pair));
    sum = _mm512_fmadd_ps(avx512::even_bf16(xv), avx512::even_bf16(w), sum);
    sum = _mm512_fmadd_ps(avx512::odd_bf16(xv), avx512::odd_bf16(w), sum);
  }
};

}  // namespace

bool mxfp4_int8_activations() { return false; }

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (use_vdpbf16ps())
    gemm_mxfp4_vdpbf16ps(x, w, y, y_stride);
  else
    gemm_tiled<avx512::Mxfp4Tiles<FmaDot>::Tile, kFmaRows, 1>(x, w, y, y_stride);
}

KT_NAMESPACE_END
