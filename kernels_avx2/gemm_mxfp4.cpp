// AVX2 MXFP4 GEMM (the universal fallback): E2M1 nibbles -> bf16 pairs by byte-shuffle lookups,
// widened to fp32 and FMA'd with activations widened to fp32 once per call; each 32-input block's
// partial sums are scaled by its E8M0 power of two (exact) and accumulated in fp32. One tile covers
// 8 of a group's 16 rows (one ymm), so the two halves of a group are done one after the other.
#include "bf16_pairs.h"

KT_NAMESPACE_BEGIN
namespace {

using avx2::even_bf16;
using avx2::odd_bf16;

constexpr int kRows = 4;

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
  static void run(const float* const* x, const PackedGroups& w, float* y, size_t y_stride) {
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
          const uint8_t* half_chunk = w.values + (b * 4 + c) * kMxfp4ChunkBytes + half * 32;
          prefetch_weights(half_chunk);
          decoder.decode(half_chunk, ops);
          for (int q = 0; q < 4; ++q) {
            const int pair = b * 16 + c * 4 + q;
            const __m256 w_even = even_bf16(ops[q]), w_odd = odd_bf16(ops[q]);
            for (int i = 0; i < M; ++i) {
              __m256& sum = part[i][q % kChains];
              sum = _mm256_fmadd_ps(_mm256_broadcast_ss(x[i] + 2 * pair), w_even, sum);
              sum = _mm256_fmadd_ps(_mm256_broadcast_ss(x[i] + 2 * pair + 1), w_odd, sum);
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

// Prefill: with many activation rows, each group's weights are decoded (and scaled) to fp32 once
// per chunk of inputs, then a plain fp32 FMA tile runs every row over them.
constexpr int kDecodedMinRows = 8;
constexpr int kDecodedPairs = 128;    // inputs 2 x 128 per chunk: 16 KiB of fp32 weights
constexpr int kFloatsPerPair = 32;    // even inputs of rows 0-7, 8-15, then odd inputs of rows 0-7, 8-15
constexpr int kDecodedRows = 4;

void decode_chunk(const PackedGroups& group, int first_pair, int pairs, float* out) {
  const Mxfp4Decoder decoder;
  for (int pair = first_pair; pair < first_pair + pairs; pair += 16) {  // one 32-input block
    const int b = pair / 16;
    for (int half = 0; half < 2; ++half) {
      const __m256 scale = e8m0_scales(group.scales + b * kGroupRows + half * 8);
      for (int c = 0; c < 4; ++c) {
        __m256i ops[4];
        decoder.decode(group.values + (b * 4 + c) * kMxfp4ChunkBytes + half * 32, ops);
        for (int q = 0; q < 4; ++q) {
          float* at = out + size_t(pair - first_pair + c * 4 + q) * kFloatsPerPair + half * 8;
          _mm256_store_ps(at, _mm256_mul_ps(even_bf16(ops[q]), scale));
          _mm256_store_ps(at + 16, _mm256_mul_ps(odd_bf16(ops[q]), scale));
        }
      }
    }
  }
}

template <int M, int NV>
struct DecodedTile {
  static_assert(NV == 1);
  // y (+)= x . decoded weights of pairs [first_pair, first_pair + pairs); x rows already offset.
  static void run(const float* const* x, const float* decoded, int first_pair, int pairs, float* y,
                  size_t y_stride, bool accumulate) {
    __m256 acc[M][2];
    for (int i = 0; i < M; ++i)
      for (int h = 0; h < 2; ++h)
        acc[i][h] = accumulate ? _mm256_loadu_ps(y + i * y_stride + h * 8) : _mm256_setzero_ps();
    for (int p = 0; p < pairs; ++p) {
      const float* wp = decoded + size_t(p) * kFloatsPerPair;
      const __m256 even0 = _mm256_load_ps(wp), even1 = _mm256_load_ps(wp + 8);
      const __m256 odd0 = _mm256_load_ps(wp + 16), odd1 = _mm256_load_ps(wp + 24);
      for (int i = 0; i < M; ++i) {
        const __m256 xe = _mm256_broadcast_ss(x[i] + 2 * (first_pair + p));
        const __m256 xo = _mm256_broadcast_ss(x[i] + 2 * (first_pair + p) + 1);
        acc[i][0] = _mm256_fmadd_ps(xo, odd0, _mm256_fmadd_ps(xe, even0, acc[i][0]));
        acc[i][1] = _mm256_fmadd_ps(xo, odd1, _mm256_fmadd_ps(xe, even1, acc[i][1]));
      }
    }
    for (int i = 0; i < M; ++i)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + i * y_stride + h * 8, acc[i][h]);
  }
};

using DecodedTileFn = void (*)(const float* const*, const float*, int, int, float*, size_t, bool);
constexpr DecodedTileFn kDecodedTiles[kDecodedRows] = {&DecodedTile<1, 1>::run, &DecodedTile<2, 1>::run,
                                                       &DecodedTile<3, 1>::run, &DecodedTile<4, 1>::run};

void gemm_decoded(const float* rows, int m, const PackedGroups& w, float* y, size_t y_stride) {
  thread_local AlignedBuffer<float> decoded;
  decoded.reserve(size_t(kDecodedPairs) * kFloatsPerPair);
  const int k_pairs = w.k / 2;
  for (int g = 0; g < w.groups; ++g) {
    PackedGroups group = w;
    group.values += g * w.group_bytes;
    group.scales += g * w.group_scale_bytes;
    for (int first_pair = 0; first_pair < k_pairs; first_pair += kDecodedPairs) {
      const int pairs = std::min(kDecodedPairs, k_pairs - first_pair);
      decode_chunk(group, first_pair, pairs, decoded.data());
      for (int i0 = 0; i0 < m; i0 += kDecodedRows) {
        const int mm = std::min(kDecodedRows, m - i0);
        const float* x[kDecodedRows];
        for (int i = 0; i < mm; ++i) x[i] = rows + size_t(i0 + i) * w.k;
        kDecodedTiles[mm - 1](x, decoded.data(), first_pair, pairs, y + size_t(i0) * y_stride + g * kGroupRows,
                              y_stride, first_pair > 0);
      }
    }
  }
}

}  // namespace

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const float* rows = avx2::widen_rows(x, w.k);
  if (x.rows >= kDecodedMinRows)
    gemm_decoded(rows, x.rows, w, y, y_stride);
  else
    gemm_tiled<FmaTile, kRows, 1, const float*>([&](int i) { return rows + size_t(i) * w.k; }, x.rows, w, y, y_stride);
}

KT_NAMESPACE_END
