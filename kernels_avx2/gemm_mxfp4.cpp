// AVX2 MXFP4 GEMM (the universal fallback): E2M1 nibbles -> bf16 pairs by byte-shuffle lookups,
// widened to fp32 and FMA'd; each 32-input block's partial sums are scaled by
// its E8M0 power of two (exact) and accumulated in fp32. One tile covers 8 of a group's 16 rows
// (one ymm), so the two halves of a group are done one after the other.
#include "bf16_pairs.h"

KT_NAMESPACE_BEGIN
namespace {

using avx2::even_bf16;
using avx2::odd_bf16;

constexpr int kRows = 2;

// Decodes 32 bytes (half a 64-byte chunk: 8 rows) into 4 operands of 8 rows x inputs (2j, 2j+1):
// a shift and a mask isolate each pair's two codes in the low bytes of the two 16-bit halves; two
// byte lookups give the bf16 low and high bytes.
struct Mxfp4Decoder {
  __m256i low = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Bf16Low)));
  __m256i high = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Bf16High)));
  __m256i pair_mask = _mm256_set1_epi32(kMxfp4PairMask);

  __m256i lookup(__m256i codes) const {
    return _mm256_or_si256(_mm256_shuffle_epi8(low, codes), _mm256_slli_epi16(_mm256_shuffle_epi8(high, codes), 8));
  }
  void decode(const uint8_t* half_chunk, __m256i out[4]) const {
    const __m256i words = _mm256_load_si256(reinterpret_cast<const __m256i*>(half_chunk));
    out[0] = lookup(_mm256_and_si256(words, pair_mask));
    out[1] = lookup(_mm256_and_si256(_mm256_srli_epi32(words, 4), pair_mask));
    out[2] = lookup(_mm256_and_si256(_mm256_srli_epi32(words, 8), pair_mask));
    out[3] = lookup(_mm256_and_si256(_mm256_srli_epi32(words, 12), pair_mask));
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
  static constexpr int kChains = accumulator_chains(M);
  static void run(const bf16_t* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const Mxfp4Decoder decoder;
    for (int half = 0; half < 2; ++half) {
      __m256 acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
      for (int b = 0; b < w.k / kMxfp4Block; ++b) {
        __m256 part[M][kChains];  // this block's unscaled sums
        for (int i = 0; i < M; ++i)
          for (int h = 0; h < kChains; ++h) part[i][h] = _mm256_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          __m256i ops[4];
          decoder.decode(w.values + (b * 4 + c) * kMxfp4ChunkBytes + half * 32, ops);
          for (int q = 0; q < 4; ++q) {
            const int pair = b * 16 + c * 4 + q;
            const __m256 w_even = even_bf16(ops[q]), w_odd = odd_bf16(ops[q]);
            for (int i = 0; i < M; ++i) {
              const __m256i xv = _mm256_set1_epi32(load_bf16_pair(x[i] + 2 * pair));
              __m256& sum = part[i][q % kChains];
              sum = _mm256_fmadd_ps(odd_bf16(xv), w_odd, _mm256_fmadd_ps(even_bf16(xv), w_even, sum));
            }
          }
        }
        const __m256 scale = e8m0_scales(w.scales + b * kGroupRows + half * 8);
        for (int i = 0; i < M; ++i) {
          __m256 sum = part[i][0];
          for (int h = 1; h < kChains; ++h) sum = _mm256_add_ps(sum, part[i][h]);
          acc[i] = _mm256_fmadd_ps(sum, scale, acc[i]);
        }
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
