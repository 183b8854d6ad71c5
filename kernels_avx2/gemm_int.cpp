// AVX2 INT8 / INT4 / MXFP4 / GGUF GEMMs (the universal fallback): the integer tiles
// (kernels_common/int_tiles.h) on ymm vectors, with the u8 x s8 dot product emulated by vpmaddwd on
// int16 activations (INT8; INT4 and MXFP4 on a row and its residual) or vpmaddubsw on int8 rows
// (MXFP4 with its E2M1 codes looked up as integers by vpshufb).
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx2 {
namespace {

// One group (two ymm) per tile: 16 registers do not hold more. 4-bit tiles of int8 rows: 2 rows, or a
// token's row and residual, x 2 halves of int32 sums and int16 partials. Of int16 tokens, 8 tokens:
// their sums spill to the stack, but each decoded line then serves more tokens (one core, 768 x
// 2048, 32 tokens: INT4 80, 89, 93, 99, 105 and 107 GOP/s with 2, 3, 4, 6, 8 and 12 tokens; MXFP4 71
// to 96).
constexpr int kInt8Tokens = 4, kFourBitRows = 2, kFourBitTokens = 8;

}  // namespace

void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_int8_maddwd<Vec, kInt8Tokens, 1>(x, w, y, y_stride);
}

void gemm_int4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit_maddwd<Vec, Int4Format<Vec>, kFourBitRows, 1, kFourBitTokens, 1>(x, w, y, y_stride);
}

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit_maddwd<Vec, Mxfp4Format<Vec>, kFourBitRows, 1, kFourBitTokens, 1>(x, w, y, y_stride);
}

void gemm_gguf(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (gemm_gguf_one_token(x, w, y, y_stride)) return;
  gemm_gguf_maddwd<Vec, kFourBitRows, 1, kFourBitTokens, 1>(x, w, y, y_stride);
}

}  // namespace avx2
KT_NAMESPACE_END
