// AVX2 INT8 / INT4 / MXFP4 GEMMs (the universal fallback): the integer tiles
// (kernels_common/int_tiles.h) on ymm vectors, with the u8 x s8 dot product emulated by vpmaddwd
// (INT8) or vpmaddubsw (INT4, and MXFP4 with its E2M1 codes looked up as integers by vpshufb).
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx2 {
namespace {

// One group (two ymm) per tile: 16 registers do not hold more. MXFP4: 2 rows x 2 halves of integer
// and float accumulators.
constexpr int kInt8Rows = 4, kInt4Rows = 2, kMxfp4Rows = 2;

// The rows of x as MaddwdDot reads them, in x.scratch.
const int16_t* widen_pairs(const Activations& x, int k) {
  int16_t* widened = reinterpret_cast<int16_t*>(x.scratch);
  const int row_elems = round_up(k, 4);
  for (int i = 0; i < x.rows; ++i) {
    const int8_t* src = x.quantized_row(i).values;
    int16_t* dst = widened + size_t(i) * row_elems;
    for (int c = 0; c < row_elems; c += 4)
      dst[c] = src[c], dst[c + 1] = src[c + 2], dst[c + 2] = src[c + 1], dst[c + 3] = src[c + 3];
  }
  return widened;
}

}  // namespace

void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const int16_t* widened = widen_pairs(x, w.k);
  gemm_tiled<IntTiles<Vec, MaddwdDot>::Int8, kInt8Rows, 1, QuantizedRow>(
      [&](int i) {
        QuantizedRow row = x.quantized_row(i);
        row.values = reinterpret_cast<const int8_t*>(widened + size_t(i) * round_up(w.k, 4));
        return row;
      },
      x.rows, w, y, y_stride);
}

void gemm_int4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_parts<IntTiles<Vec, MaddubsDot>::FourBitTile, kInt4Rows, 1, 1>(x, w, y, y_stride);
}

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_parts<IntTiles<Vec, MaddubsDot, Mxfp4Format<Vec>>::FourBitTile, kMxfp4Rows, 1, 1>(x, w, y, y_stride);
}

}  // namespace avx2
KT_NAMESPACE_END
