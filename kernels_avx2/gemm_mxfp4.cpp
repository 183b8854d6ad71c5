// AVX2 MXFP4 GEMM (the universal fallback): E2M1 nibbles -> bf16 pairs by byte-shuffle lookups in
// each 128-bit lane, widened to fp32 and FMA'd; each 32-input block's partial sums are scaled by
// its E8M0 power of two (exact) and accumulated in fp32. One tile covers 8 of a group's 16 rows
// (one ymm), so the two halves of a group are done one after the other.
#include "bf16_pairs.h"

KT_NAMESPACE_BEGIN
namespace {

using avx2::even_bf16;
using avx2::odd_bf16;

constexpr int kRows = 2;

// Decodes 32 bytes (half a 64-byte chunk: 8 rows) into 4 operands of 8 rows x inputs (2j, 2j+1).
struct Mxfp4Decoder {
  __m256i low = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Bf16Low)));
  __m256i high = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Bf16High)));
  __m256i nibble = _mm256_set1_epi8(0x0F);

  void decode(const uint8_t* half_chunk, __m256i out[4]) const {
    const __m256i bytes = _mm256_load_si256(reinterpret_cast<const __m256i*>(half_chunk));
    const __m256i even = _mm256_and_si256(bytes, nibble);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    const __m256i even_lo = _mm256_shuffle_epi8(low, even), even_hi = _mm256_shuffle_epi8(high, even);
    const __m256i odd_lo = _mm256_shuffle_epi8(low, odd), odd_hi = _mm256_shuffle_epi8(high, odd);
    const __m256i even_a = _mm256_unpacklo_epi8(even_lo, even_hi), even_b = _mm256_unpackhi_epi8(even_lo, even_hi);
    const __m256i odd_a = _mm256_unpacklo_epi8(odd_lo, odd_hi), odd_b = _mm256_unpackhi_epi8(odd_lo, odd_hi);
    out[0] = _mm256_unpacklo_epi16(even_a, odd_a);
    out[1] = _mm256_unpackhi_epi16(even_a, odd_a);
    out[2] = _mm256_unpacklo_epi16(even_b, odd_b);
    out[3] = _mm256_unpackhi_epi16(even_b, odd_b);
  }
};

// 8 E8M0 bytes -> 8 fp32 powers of two.
inline __m256 e8m0_scales(const uint8_t* scales) {
  const __m256i bits =
      _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales))), 23);
  return _mm256_castsi256_ps(_mm256_max_epi32(bits, _mm256_set1_epi32(kE8M0ZeroBits)));
}

template <int M, int NV>
struct FmaTile {
  static_assert(NV == 1);
  static void run(const bf16_t* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const Mxfp4Decoder decoder;
    for (int half = 0; half < 2; ++half) {
      __m256 acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
      for (int b = 0; b < w.k / kMxfp4Block; ++b) {
        __m256 part[M];
        for (int i = 0; i < M; ++i) part[i] = _mm256_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          __m256i ops[4];
          decoder.decode(w.values + (b * 4 + c) * kMxfp4ChunkBytes + half * 32, ops);
          for (int q = 0; q < 4; ++q) {
            const int pair = b * 16 + c * 4 + q;
            const __m256 w_even = even_bf16(ops[q]), w_odd = odd_bf16(ops[q]);
            for (int i = 0; i < M; ++i) {
              const __m256i xv = _mm256_set1_epi32(load_bf16_pair(x[i] + 2 * pair));
              part[i] = _mm256_fmadd_ps(even_bf16(xv), w_even, part[i]);
              part[i] = _mm256_fmadd_ps(odd_bf16(xv), w_odd, part[i]);
            }
          }
        }
        const __m256 scale = e8m0_scales(w.scales + b * kGroupRows + half * 8);
        for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(part[i], scale, acc[i]);
      }
      for (int i = 0; i < M; ++i) _mm256_storeu_ps(y + i * y_stride + half * 8, acc[i]);
    }
  }
};

}  // namespace

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<FmaTile, kRows, 1>(x, w, y, y_stride);
}

KT_NAMESPACE_END
