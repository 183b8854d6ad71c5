// AVX2 MXFP4 GEMM (the universal fallback): the 4-bit integer tiles (src/core/int_tiles.h) with
// E2M1 codes looked up as integers by vpshufb and multiplied with int8 activations by vpmaddubsw.
#include "int_dots.h"

KT_NAMESPACE_BEGIN
namespace {

constexpr int kRows = 2;  // 16 ymm registers: 2 rows x 2 halves of integer and float accumulators

}  // namespace

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  using Tiles = IntTiles<avx2::Vec, avx2::MaddubsDot, Mxfp4Format<avx2::Vec>>;
  gemm_tiled_quantized<Tiles::FourBitTile, kRows, 1>(x, w, y, y_stride);
}

KT_NAMESPACE_END
