// AVX2 INT8 / INT4 GEMMs: the integer tiles (src/core/int_tiles.h) on ymm vectors (a 16-row group is
// two of them), with the u8 x s8 dot product emulated by vpmaddwd (INT8) or vpmaddubsw (INT4).
#include <immintrin.h>

#include "int_tiles.h"

KT_NAMESPACE_BEGIN
namespace {

struct Vec {
  using Int = __m256i;
  using Float = __m256;
  static constexpr int kLanes = 8;
  static Int load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static Float load_ps(const float* p) { return _mm256_load_ps(p); }
  static Int set1(int32_t v) { return _mm256_set1_epi32(v); }
  static Float set1_ps(float v) { return _mm256_set1_ps(v); }
  static Int and_(Int a, Int b) { return _mm256_and_si256(a, b); }
  static Int srli_epi32(Int a, int n) { return _mm256_srli_epi32(a, n); }
  static Int sub_epi32(Int a, Int b) { return _mm256_sub_epi32(a, b); }
  static Float to_float(Int a) { return _mm256_cvtepi32_ps(a); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static void storeu_ps(float* p, Float a) { _mm256_storeu_ps(p, a); }
};

// Any u8 weight: even and odd bytes zero-extended to 16 bits, vpmaddwd with the activations'
// matching bytes sign-extended: the exact u8 x s8 quad sum without saturation.
struct MaddwdDot {
  struct Weights {
    __m256i even, odd;
  };
  using Act = Weights;
  static Weights weights(__m256i line) {
    return {_mm256_and_si256(line, _mm256_set1_epi16(0x00FF)), _mm256_srli_epi16(line, 8)};
  }
  static Act activation(int32_t quad) {
    const __m256i q = _mm256_set1_epi32(quad);
    return {_mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8), _mm256_srai_epi16(q, 8)};
  }
  static __m256i dot(__m256i acc, const Weights& w, const Act& a) {
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(w.even, a.even), _mm256_madd_epi16(w.odd, a.odd)));
  }
};

// Weights 0..15 (INT4): vpmaddubsw cannot saturate (2 * 15 * 127 < 2^15), vpmaddwd by 1 widens.
struct MaddubsDot {
  using Weights = __m256i;
  using Act = __m256i;
  static Weights weights(__m256i line) { return line; }
  static Act activation(int32_t quad) { return _mm256_set1_epi32(quad); }
  static __m256i dot(__m256i acc, Weights w, Act a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
  }
};

// One group (two ymm) per tile: 16 registers do not hold more.
constexpr int kInt8Rows = 3, kInt4Rows = 2;

}  // namespace

void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_quantized<IntTiles<Vec, MaddwdDot>::Int8, kInt8Rows, 1>(x, w, y, y_stride);
}

void gemm_int4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_quantized<IntTiles<Vec, MaddubsDot>::Int4, kInt4Rows, 1>(x, w, y, y_stride);
}

KT_NAMESPACE_END
