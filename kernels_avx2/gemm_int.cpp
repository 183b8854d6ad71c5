// AVX2 INT8 / INT4 / MXFP4 GEMMs (the universal fallback): the integer tiles
// (kernels_common/int_tiles.h) on ymm vectors, with the u8 x s8 dot product emulated by vpmaddwd on
// int16 activations (INT8; INT4 and MXFP4 on a row and its residual) or vpmaddubsw on int8 rows
// (MXFP4 with its E2M1 codes looked up as integers by vpshufb).
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx2 {
namespace {

// One group (two ymm) per tile: 16 registers do not hold more. 4-bit tiles of int8 rows: 2 rows x 2
// halves of integer and float accumulators. Of int16 tokens, 8 tokens: their sums spill to the
// stack, but each decoded line then serves more tokens (one core, 768 x 2048, 32 tokens: INT4 80,
// 89, 93, 99, 105 and 107 GOP/s with 2, 3, 4, 6, 8 and 12 tokens; MXFP4 71 to 96).
constexpr int kInt8Rows = 4, kFourBitRows = 2, kWideTokens = 8;

// x's tokens as MaddwdDot reads them, widened into x.scratch: a token is a quantized row, or (parts
// = 2) a row q and its residual r at 1/256 of its scale, taken as the one int16 row 256 q + r (at
// most 32,639): one vpmaddwd then multiplies both, where two int8 rows took two. Quad j of a token
// is int16 {x[4j], x[4j+2]}, {x[4j+1], x[4j+3]}.
struct WidenedTokens {
  const Activations& x;
  const int16_t* values;
  const int32_t* block_sums;  // parts = 2: 256 x the row's + the residual's
  size_t row_elems, blocks;
  int count;
  QuantizedRow operator()(int t) const {
    const int parts = x.quantized.parts;
    const QuantizedRow last = x.quantized_row(parts * t + parts - 1);  // the residual carries the scale
    return {reinterpret_cast<const int8_t*>(values + t * row_elems),
            parts == 1 ? last.block_sums : block_sums + t * blocks, last.scale};
  }
};

WidenedTokens widen_tokens(const Activations& x, int k) {
  const int parts = x.quantized.parts, tokens = x.rows / parts;
  const size_t row_elems = round_up(k, 4), blocks = round_up(k, kActivationBlock) / kActivationBlock;
  int16_t* values = reinterpret_cast<int16_t*>(x.scratch);
  int32_t* block_sums = reinterpret_cast<int32_t*>(values + tokens * row_elems);  // kernels.h sizes scratch
  constexpr int kQuadOrder[4] = {0, 2, 1, 3};
  for (int t = 0; t < tokens; ++t) {
    const QuantizedRow row = x.quantized_row(parts * t);
    int16_t* dst = values + t * row_elems;
    if (parts == 1) {
      for (size_t c = 0; c < row_elems; c += 4)
        for (int e = 0; e < 4; ++e) dst[c + e] = row.values[c + kQuadOrder[e]];
      continue;
    }
    const QuantizedRow residual = x.quantized_row(parts * t + 1);
    for (size_t c = 0; c < row_elems; c += 4)
      for (int e = 0; e < 4; ++e)
        dst[c + e] = int16_t(256 * row.values[c + kQuadOrder[e]] + residual.values[c + kQuadOrder[e]]);
    for (size_t b = 0; b < blocks; ++b) block_sums[t * blocks + b] = 256 * row.block_sums[b] + residual.block_sums[b];
  }
  return {x, values, block_sums, row_elems, blocks, tokens};
}

}  // namespace

void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const WidenedTokens tokens = widen_tokens(x, w.k);
  gemm_tiled<IntTiles<Vec, MaddwdDot>::Int8, kInt8Rows, 1, QuantizedRow>(tokens, tokens.count, w, y,
                                                                        x.quantized.parts * y_stride);
  zero_residual_outputs(x, w, y, y_stride);
}

// A 4-bit GEMM: tokens of a row and its residual, as one int16 row each (MaddwdDot: 4 multiplies and
// 4 adds per line, token and 8 rows, where vpmaddubsw on both int8 rows takes 6 and 4); one token
// (decode) or int8 activations on int8 rows (MaddubsDot), which is faster there.
template <class FourBit>
void gemm_four_bit(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (x.quantized.parts == 2 && x.rows > 2 && pairs_fit<FourBit>(w)) {
    const WidenedTokens tokens = widen_tokens(x, w.k);
    gemm_tiled<IntTiles<Vec, MaddwdDot, FourBit>::template FourBitTile, kWideTokens, 1, QuantizedParts<1>>(
        [&](int t) { return QuantizedParts<1>{{tokens(t)}}; }, tokens.count, w, y, 2 * y_stride);
    zero_residual_outputs(x, w, y, y_stride);
  } else {
    gemm_tiled_parts<IntTiles<Vec, MaddubsDot, FourBit>::template FourBitTile, kFourBitRows, 1, 1>(x, w, y, y_stride);
  }
}

void gemm_int4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Int4Format<Vec>>(x, w, y, y_stride);
}

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Mxfp4Format<Vec>>(x, w, y, y_stride);
}

}  // namespace avx2
KT_NAMESPACE_END
