// Helpers shared by the AVX2 kernels.
#pragma once

#include <immintrin.h>

#include "bf16.h"
#include "gemm_tiles.h"

KT_NAMESPACE_BEGIN
namespace avx2 {

// bf16 -> fp32 of the even (low half) and odd (high half) element of each 32-bit lane.
inline __m256 even_bf16(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

// The activation rows widened to fp32 once per GEMM call (rows of round_up(k, 2) floats, in a
// thread-local buffer that only grows): the tiles then broadcast them straight from memory instead
// of widening every pair again for every weight vector.
inline const float* widen_rows(const Activations& x, int k) {
  thread_local AlignedBuffer<float> widened;
  const int row_elems = round_up(k, 2);
  widened.reserve(size_t(x.rows) * row_elems);
  for (int i = 0; i < x.rows; ++i) {
    const bf16_t* src = x.row(i);
    float* dst = widened.data() + size_t(i) * row_elems;
    for (int c = 0; c < row_elems; ++c) dst[c] = bf16_to_float(src[c]);
  }
  return widened.data();
}

}  // namespace avx2
KT_NAMESPACE_END
