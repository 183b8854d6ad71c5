// The AVX512 MXFP4 tile, shared by both multiply paths: E2M1 codes -> bf16 pairs by word-table
// lookups (vpermw), a block's 32 inputs multiplied by `Dot` (vdpbf16ps, or bf16 -> fp32 and FMA),
// each block's sum scaled by its E8M0 power of two (exact) and accumulated in fp32.
#pragma once

#include "paths.h"

KT_NAMESPACE_BEGIN
namespace avx512 {

// Decodes a 64-byte chunk into 4 operands: operand q = 16 rows x inputs (2j, 2j+1), j = 4c + q:
// a shift and a mask isolate each pair's two codes, one vpermw looks both up.
struct Mxfp4Decoder {
  __m512i table = _mm512_broadcast_i32x8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kE2M1Bf16)));
  __m512i pair_mask = _mm512_set1_epi32(kMxfp4PairMask);

  void decode(const uint8_t* chunk, __m512i out[4]) const {
    const __m512i words = _mm512_load_si512(chunk);
    out[0] = _mm512_permutexvar_epi16(_mm512_and_si512(words, pair_mask), table);
    out[1] = _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi32(words, 4), pair_mask), table);
    out[2] = _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi32(words, 8), pair_mask), table);
    out[3] = _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi32(words, 12), pair_mask), table);
  }
};

// 16 E8M0 bytes -> 16 fp32 powers of two.
inline __m512 e8m0_scales(const uint8_t* scales) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23);
  return _mm512_castsi512_ps(_mm512_max_epi32(bits, _mm512_set1_epi32(kE8M0ZeroBits)));
}

// Dot::accumulate(sum, x, w): sum += the 16 rows of bf16-pair operand w times the pair at x.
template <class Dot>
struct Mxfp4Tiles {
  template <int M, int NV>
  struct Tile {
    static_assert(NV == 1);
    static constexpr int kChains = accumulator_chains(M);
    static void run(const bf16_t* const* x, const PackedGroups& w, float* y, size_t y_stride) {
      const Mxfp4Decoder decoder;
      __m512 acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
      for (int b = 0; b < w.k / kMxfp4Block; ++b) {
        __m512 part[M][kChains];  // this block's unscaled sums
        for (int i = 0; i < M; ++i)
          for (int h = 0; h < kChains; ++h) part[i][h] = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          __m512i ops[4];
          const uint8_t* chunk = w.values + (b * 4 + c) * kMxfp4ChunkBytes;
          prefetch_weights(chunk);
          decoder.decode(chunk, ops);
          for (int q = 0; q < 4; ++q)
            for (int i = 0; i < M; ++i) Dot::accumulate(part[i][q % kChains], x[i] + 2 * (b * 16 + c * 4 + q), ops[q]);
        }
        const __m512 scale = e8m0_scales(w.scales + b * kGroupRows);
        for (int i = 0; i < M; ++i) {
          __m512 sum = part[i][0];
          for (int h = 1; h < kChains; ++h) sum = _mm512_add_ps(sum, part[i][h]);
          acc[i] = _mm512_fmadd_ps(sum, scale, acc[i]);
        }
      }
      for (int i = 0; i < M; ++i) _mm512_storeu_ps(y + i * y_stride, acc[i]);
    }
  };
};

}  // namespace avx512
KT_NAMESPACE_END
