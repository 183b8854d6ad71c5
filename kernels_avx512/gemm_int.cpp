// AVX512 INT8 / INT4 / MXFP4 GEMMs without AVX512_VNNI: the u8 x s8 dot product emulated by
// AVX512BW vpmaddwd on int16 activations or vpmaddubsw on int8 rows, as on AVX2 (the vpdpbusd paths
// are vpdpbusd.cpp). The tiles are kernels_common/int_tiles.h; MXFP4 looks its E2M1 codes up as
// integers by vpshufb.
#include "int_tiles.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// Tiles of 4 int8 rows (or widened tokens: INT8) x 2 groups; of 6 widened 4-bit tokens x 2 groups
// (one core, 768 x 2048, 32 tokens: INT4 147, 150 and 154 GOP/s with 4 x 2, 8 x 1 and 6 x 2).
constexpr int kRows = 4, kGroups = 2;
constexpr int kTokens = 6, kTokenGroups = 2;

}  // namespace

void gemm_int8_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_int8_maddwd<Vec, kRows, kGroups>(x, w, y, y_stride);
}

void gemm_mxfp4_maddubs(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit_maddwd<Vec, Mxfp4Format<Vec>, kRows, kGroups, kTokens, kTokenGroups>(x, w, y, y_stride);
}

void gemm_gguf_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_gguf_maddwd<Vec, kRows, kGroups, kTokens, kTokenGroups>(x, w, y, y_stride);
}

void gemm_int4_maddubs(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit_maddwd<Vec, Int4Format<Vec>, kRows, kGroups, kTokens, kTokenGroups>(x, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
