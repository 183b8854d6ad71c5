// AVX512 INT8 / INT4 / MXFP4 GEMMs without AVX512_VNNI: the u8 x s8 dot product emulated by
// AVX512BW instructions (the vpdpbusd paths are vpdpbusd.cpp). The tiles are kernels_common/int_tiles.h;
// MXFP4 looks its E2M1 codes up as integers by vpshufb.
#include "int_tiles.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

constexpr int kRows = 4, kGroups = 2;

// Any u8 weight: even and odd bytes zero-extended to 16 bits, vpmaddwd with the activations'
// matching bytes sign-extended: the exact vpdpbusd sum without saturation.
struct MaddwdDot {
  static constexpr int kQuadsPerSum = kInt8ActivationQuadsPerSum;
  struct Weights {
    __m512i even, odd;
  };
  using Act = Weights;
  static Weights weights(__m512i line) {
    return {_mm512_and_si512(line, _mm512_set1_epi16(0x00FF)), _mm512_srli_epi16(line, 8)};
  }
  static Act activation(const int8_t* values, int j) {
    const __m512i q = _mm512_set1_epi32(load_int8_quad(values + 4 * j));
    return {_mm512_srai_epi16(_mm512_slli_epi16(q, 8), 8), _mm512_srai_epi16(q, 8)};
  }
  static __m512i dot(__m512i acc, const Weights& w, const Act& a) {
    return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(w.even, a.even), _mm512_madd_epi16(w.odd, a.odd)));
  }
};

// Weights 0..24 (INT4: 0..15, MXFP4: 0..24): two vpmaddubsw summed in 16 bits cannot saturate
// (4 * 24 * 127 < 2^15); vpmaddwd by 1 widens.
struct MaddubsDot {
  using Weights = __m512i;
  using Act = __m512i;
  static Weights weights(__m512i line) { return line; }
  static Act activation(const int8_t* values, int j) { return _mm512_set1_epi32(load_int8_quad(values + 4 * j)); }
  static __m512i dot2(__m512i acc, Weights w1, Act a1, Weights w2, Act a2) {
    const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(w1, a1), _mm512_maddubs_epi16(w2, a2));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
};

}  // namespace

void gemm_int8_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_quantized<IntTiles<Vec, MaddwdDot>::Int8, kRows, kGroups>(x, w, y, y_stride);
}

void gemm_mxfp4_maddubs(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_parts<IntTiles<Vec, MaddubsDot, Mxfp4Format<Vec>>::FourBitTile, kRows, kGroups, 1>(x, w, y, y_stride);
}

void gemm_int4_maddubs(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_parts<IntTiles<Vec, MaddubsDot>::FourBitTile, kRows, kGroups, 1>(x, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
