// bf16 helpers of the AVX2 BF16 kernel.
#pragma once

#include <immintrin.h>

#include "gemm_tiles.h"

KT_NAMESPACE_BEGIN
namespace avx2 {

// bf16 -> fp32 of the even (low half) and odd (high half) element of each 32-bit lane.
inline __m256 even_bf16(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

}  // namespace avx2
KT_NAMESPACE_END
