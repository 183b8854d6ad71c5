// AVX2 FP8 GEMM: E4M3 codes decoded in registers (to bf16 bytes by a nibble lookup, or to fp16 by
// shifts) or through the stack of fp8_tiles.h, multiplied by fp32 FMA with the block scales in fp32.
// Compiled with -mavx2 -mfma -mf16c only: no AVX512 instruction may appear in this build.
#include <algorithm>

#include "fma_group.h"

KT_NAMESPACE_BEGIN
namespace avx2 {
namespace {

// FP8 (fp8_tiles.h): decoded weight lines widened like the BF16 ones, on the widened rows; the
// stack keeps them widened.
struct FmaFp8 : Vec {
  using Row = const float*;
  struct Line {
    __m256 even, odd;
  };
  using Act = Line;
  using Bits = __m256i;
  static Bits decode_bits(const uint8_t* codes) { return decode_fp8_line(codes); }
  static Line line_of(Bits pairs) { return {even_bf16(pairs), odd_bf16(pairs)}; }
  static constexpr int kCodeBytes = 1;
  static constexpr bool kScaled = true;
  using Stored = float;
  static void store_line(float* at, Bits, const Line& line) {
    _mm256_store_ps(at, line.even);
    _mm256_store_ps(at + kLanes, line.odd);
  }
  static Line load_line(const float* at) { return {_mm256_load_ps(at), _mm256_load_ps(at + kLanes)}; }
  static Act act(Row x, int p) { return {_mm256_broadcast_ss(x + 2 * p), _mm256_broadcast_ss(x + 2 * p + 1)}; }
  static Float dot(Float acc, const Line& w, const Act& a) {
    return _mm256_fmadd_ps(a.odd, w.odd, _mm256_fmadd_ps(a.even, w.even, acc));
  }
};

// FP8, one or two activation rows (decode): the codes of a pair of inputs go to fp16 by shifts
// alone and to fp32 by F16C. Exact for every code, zero and subnormals included: E4M3 bits moved up
// 7 places are the fp16 of the value / 256 (both formats have their subnormals at exponent field
// 0). So 16 weights take 6 instructions to fp32 and no line needs checking; the bf16 route takes 6
// too, plus a 3-instruction check that sends lines with a zero or subnormal code to a slow exact
// decoder. Each sum's lanes are (row, input of the pair); a scale block adds the two, then scales.
template <int M, int NV>
struct Fp8ViaF16Tile {
  static __m256i fp16_of_codes(const uint8_t* codes) {  // 16 codes -> 16 fp16 of the value / 256
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7);
    return _mm256_and_si256(shifted, _mm256_set1_epi16(int16_t(0xBFFF)));  // clears the sign's copy in bit 14
  }
  static void run(const float* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const int pairs = round_up(w.k, 2) / 2;
    const int block_pairs = w.scale_group > 0 ? w.scale_group / 2 : pairs;
    __m256 acc[M][NV][2];  // rows 0-7 and 8-15 of each group
    for (int i = 0; i < M; ++i)
      for (int g = 0; g < NV; ++g) acc[i][g][0] = acc[i][g][1] = _mm256_setzero_ps();
    for (int p0 = 0, block = 0; p0 < pairs; p0 += block_pairs, ++block) {
      __m256 sums[M][NV][4];  // rows 0-3, 4-7, 8-11, 12-15; lanes: row r's even input, its odd input, ...
      for (int i = 0; i < M; ++i)
        for (int g = 0; g < NV; ++g)
          for (int q = 0; q < 4; ++q) sums[i][g][q] = _mm256_setzero_ps();
      for (int p = p0; p < std::min(pairs, p0 + block_pairs); ++p) {
        __m256 a[M];
        for (int i = 0; i < M; ++i)
          a[i] = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x[i] + 2 * p)));
        for (int g = 0; g < NV; ++g) {
          const uint8_t* codes = w.values + g * w.group_bytes + size_t(p) * 2 * kGroupRows;
          if (p % 2 == 0) prefetch_weights(w, g, codes);  // one per 64-byte line
          for (int h = 0; h < 2; ++h) {
            const __m256i f16 = fp16_of_codes(codes + h * kGroupRows);
            const __m256 low = _mm256_cvtph_ps(_mm256_castsi256_si128(f16));
            const __m256 high = _mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1));
            for (int i = 0; i < M; ++i) {
              sums[i][g][2 * h] = _mm256_fmadd_ps(low, a[i], sums[i][g][2 * h]);
              sums[i][g][2 * h + 1] = _mm256_fmadd_ps(high, a[i], sums[i][g][2 * h + 1]);
            }
          }
        }
      }
      for (int g = 0; g < NV; ++g) {
        const float* scales = reinterpret_cast<const float*>(w.scales + g * w.group_scale_bytes) + block * kGroupRows;
        for (int i = 0; i < M; ++i)
          for (int h = 0; h < 2; ++h) {
            // hadd gives rows 0 1 4 5 | 2 3 6 7 (of these eight); the 64-bit permute puts them in order.
            const __m256 rows = _mm256_castpd_ps(_mm256_permute4x64_pd(
                _mm256_castps_pd(_mm256_hadd_ps(sums[i][g][2 * h], sums[i][g][2 * h + 1])), 0xD8));
            acc[i][g][h] = _mm256_fmadd_ps(rows, _mm256_loadu_ps(scales + 8 * h), acc[i][g][h]);
          }
      }
    }
    for (int i = 0; i < M; ++i)
      for (int g = 0; g < NV; ++g)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(y + i * y_stride + g * kGroupRows + 8 * h, _mm256_mul_ps(acc[i][g][h], _mm256_set1_ps(256.0f)));
  }
};

// FP8, one to five activation rows, where the codes are normal ones (fp8_codes_look_normal): the 32
// codes of a packed pair (kernels.h: byte 2r + i is row r, input 2p + i) become bf16 in their own
// bytes, without widening them first. A normal code s eeee mmm is the bf16 s | (e + 120) << 7 |
// m << 4: its high byte is s << 7 | (60 + (e >> 1)), a lookup of the code's high nibble, and its low
// byte (code << 4) & 0xF0 (120 is even). Unpacking the two gives `first` = rows 0-3 and 8-11 and
// `second` = rows 4-7 and 12-15, each 32-bit lane a row's two inputs. The pairs that hold a zero or
// subnormal code (exponent field 0), which the group's bitmap marks (kernels.h), take the exact
// decoder instead.
struct Bf16Halves {
  __m256i first, second;
};
inline Bf16Halves fp8_pair_to_bf16(const uint8_t* codes) {
  const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes));
  // High nibble s e3 e2 e1 -> s << 7 | (60 + e3 e2 e1). A register constant: Vec::lookup16's table
  // from memory made the tile 10 % slower (its broadcast stayed in the loop).
  const __m256i high_bytes = _mm256_setr_epi8(60, 61, 62, 63, 64, 65, 66, 67, char(188), char(189), char(190), char(191),
                                              char(192), char(193), char(194), char(195), 60, 61, 62, 63, 64, 65, 66,
                                              67, char(188), char(189), char(190), char(191), char(192), char(193),
                                              char(194), char(195));
  const __m256i high =
      _mm256_shuffle_epi8(high_bytes, _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)));
  const __m256i low = _mm256_and_si256(_mm256_slli_epi16(raw, 4), _mm256_set1_epi8(char(0xF0)));
  return {_mm256_unpacklo_epi8(low, high), _mm256_unpackhi_epi8(low, high)};
}
inline Bf16Halves fp8_pair_to_bf16_exact(const uint8_t* codes) {
  const __m256i halves = _mm256_permute4x64_epi64(_mm256_load_si256(reinterpret_cast<const __m256i*>(codes)),
                                                  0xD8);  // bytes 0-7, 16-23 | 8-15, 24-31
  return {decode_fp8_line_exact(_mm256_castsi256_si128(halves)),
          decode_fp8_line_exact(_mm256_extracti128_si256(halves, 1))};
}

template <int M, int NV>
struct Fp8BytesTile {
  using Sums = __m256[M][NV][2];  // [0]: rows 0-3 and 8-11 of the group, [1]: rows 4-7 and 12-15

  // The activations are broadcast for each use (fma_group), so that the sums and one group's
  // weights stay in registers for up to five rows.
  template <bool kExact>
  [[gnu::always_inline]] static inline void add_pair(const float* const* x, const PackedGroups& w, int p, Sums& sums) {
    for (int g = 0; g < NV; ++g) {
      const uint8_t* codes = w.values + g * w.group_bytes + size_t(p) * 2 * kGroupRows;
      if (p % 2 == 0) prefetch_weights(w, g, codes);  // one per 64-byte line
      const Bf16Halves bf16 = kExact ? fp8_pair_to_bf16_exact(codes) : fp8_pair_to_bf16(codes);
      const GroupPair pair = {{even_bf16(bf16.first), even_bf16(bf16.second)},
                              {odd_bf16(bf16.first), odd_bf16(bf16.second)}};
      for (int i = 0; i < M; ++i) fma_group(sums[i][g][0], sums[i][g][1], x[i] + 2 * p, pair);
    }
  }

  // Pairs [begin, end), inside one 64-pair word of the bitmaps: runs of normal pairs, each marked
  // pair after a run by the exact decoder.
  static void add_pairs(const float* const* x, const PackedGroups& w, int begin, int end, Sums& sums) {
    uint64_t small = 0;
    for (int g = 0; g < NV; ++g) small |= fp8_small_codes(w, g)[begin / 64];
    small >>= begin % 64;
    if (end - begin < 64) small &= (uint64_t(1) << (end - begin)) - 1;
    for (int p = begin;;) {
      const int run_end = small == 0 ? end : begin + __builtin_ctzll(small);
      for (; p < run_end; ++p) add_pair<false>(x, w, p, sums);
      if (p == end) return;
      add_pair<true>(x, w, p++, sums);
      small &= small - 1;
    }
  }

  static void run(const float* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const int pairs = round_up(w.k, 2) / 2;
    const int block_pairs = w.scale_group > 0 ? w.scale_group / 2 : pairs;
    Sums acc;
    for (int i = 0; i < M; ++i)
      for (int g = 0; g < NV; ++g) acc[i][g][0] = acc[i][g][1] = _mm256_setzero_ps();
    for (int p0 = 0, block = 0; p0 < pairs; p0 += block_pairs, ++block) {
      Sums sums;
      for (int i = 0; i < M; ++i)
        for (int g = 0; g < NV; ++g) sums[i][g][0] = sums[i][g][1] = _mm256_setzero_ps();
      const int end = std::min(pairs, p0 + block_pairs);
      for (int begin = p0, stop; begin < end; begin = stop) {
        stop = std::min(end, (begin / 64 + 1) * 64);  // the end of begin's bitmap word
        add_pairs(x, w, begin, stop, sums);
      }
      for (int g = 0; g < NV; ++g) {
        const float* scales = reinterpret_cast<const float*>(w.scales + g * w.group_scale_bytes) + block * kGroupRows;
        const __m256 rows_0_7 = _mm256_loadu_ps(scales), rows_8_15 = _mm256_loadu_ps(scales + 8);
        const __m256 scale[2] = {_mm256_permute2f128_ps(rows_0_7, rows_8_15, 0x20),
                                 _mm256_permute2f128_ps(rows_0_7, rows_8_15, 0x31)};
        for (int i = 0; i < M; ++i)
          for (int h = 0; h < 2; ++h) acc[i][g][h] = _mm256_fmadd_ps(sums[i][g][h], scale[h], acc[i][g][h]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int g = 0; g < NV; ++g) {
        float* out = y + i * y_stride + g * kGroupRows;
        _mm256_storeu_ps(out, _mm256_permute2f128_ps(acc[i][g][0], acc[i][g][1], 0x20));
        _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(acc[i][g][0], acc[i][g][1], 0x31));
      }
  }
};

// Whether w's codes look normal: at most one in 16 input pairs of its first group holds a zero or
// subnormal code (its bitmap, kernels.h). Gaussian weights with a scale per block have about one such
// code in 10^4, so nearly every matrix passes; one with many (pruned to zeros, say) fails and keeps
// the tiles that decode every code exactly: one core, one row, 768 x 2048 in cache, 1 % zero codes:
// Fp8BytesTile 4.3 Gweights/s, Fp8ViaF16Tile 11.8.
inline bool fp8_codes_look_normal(const PackedGroups& w) {
  const uint64_t* small_codes = fp8_small_codes(w, 0);
  int with_small_codes = 0;
  for (int word = 0; word < fp8_small_code_words(w.k); ++word)
    with_small_codes += __builtin_popcountll(small_codes[word]);
  return with_small_codes * 16 <= ceil_div(w.k, 2);
}

}  // namespace

void gemm_fp8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const WidenedRows row = widen_rows(x, w.k);
  // Up to five rows of normal codes: Fp8BytesTile (one core, 128 outputs x 7168 inputs in cache,
  // Gweights/s: 1 row 17, 2 rows 13, 3 rows 10, 4 rows 9, 5 rows 7.4 against the stack's 5.7). Else
  // one row: 1 x 2 tiles, eight sums; two: 2 x 1 tiles. More rows: the stack, where each code is
  // decoded once per tile of rows and read back as fp32, in tiles of kFmaRows x kFmaGroups like the BF16
  // ones (one core, in cache, GOP/s at 9 / 128 rows: 62 / 76 against 53 / 74 with 4 x 1 tiles).
  if (x.rows <= 5 && fp8_codes_look_normal(w)) {
    if (x.rows <= 2)
      gemm_tiled<Fp8BytesTile, 2, 2, const float*>(row, x.rows, w, y, y_stride);
    else
      gemm_tiled<Fp8BytesTile, 5, 1, const float*>(row, x.rows, w, y, y_stride);
  } else if (x.rows == 1)
    gemm_tiled<Fp8ViaF16Tile, 1, 2, const float*>(row, x.rows, w, y, y_stride);
  else if (x.rows == 2)
    gemm_tiled<Fp8ViaF16Tile, 2, 1, const float*>(row, x.rows, w, y, y_stride);
  else
    gemm_lines_on_stack<FmaFp8, kFmaRows, kFmaGroups>(row, x.rows, w, y, y_stride);
}

}  // namespace avx2
KT_NAMESPACE_END
