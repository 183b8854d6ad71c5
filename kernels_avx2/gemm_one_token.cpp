// Q4_K and Q6_K a token at a time on AVX2 without AVX-VNNI (Zen 2/3, Intel before Alder Lake),
// exact: the token's row and residual (QuantizedParts<2>) against GGUF's Q4_K (4-bit values, 6-bit
// factored scales and mins) or Q6_K (6-bit value planes, int8 factored scales), as held (kernels.h:
// GGUF). The shared 4-bit tile (int_tiles.h) serves every format and count of tokens; for these it
// kept more ymm live than there are through a scale group's lines and spilled, converted every
// group's scale (and min) to fp32, and widened Q6_K's int16 products every line: 294 and 206
// instructions per 16 rows x 32 and 16 inputs (callgrind, bench/one_layer.py gguf:q4_k / gguf:q6_k
// 1 3). Here, as ggml does, each group's int16 products are widened by vpmaddwd by the group's
// integer multiple itself (Q4_K's row by 256 times it), the sums converted and multiplied by a factor
// once per group (Q4_K) or per block of 256 inputs (Q6_K: the row's and the residual's apart), and the
// mins (Q6_K: the values' offset, lowest x sum(x)) taken a block at a time, in int32, after the
// values. (MXFP4 in a tile of this kind took 27 % fewer instructions but no less time:
// docs/perf-log/2026-11-30-zen4-one-token-tiles.md.)
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx2 {
namespace {

constexpr int kBlockGroups = kGgufBlockInputs / 32;  // 32-input scale groups per factor block
constexpr int kGroupLines = 4;                        // nibble lines (8 inputs of 16 rows) per group

// vpshufb controls for six_bit_multiples: lane r of rows 8h.. takes the bytes o, o + 1 (o = 6h + 6r / 8)
// into its low 16 bits and, for pairs, again into its high 16 bits.
struct MultipleControls {
  alignas(32) int8_t bytes[2][2][32];  // [pairs][h]
};
constexpr MultipleControls multiple_controls() {
  MultipleControls c{};
  for (int pairs = 0; pairs < 2; ++pairs)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 8; ++r) {
        const int8_t o = int8_t(6 * h + 6 * r / 8);
        int8_t* lane = c.bytes[pairs][h] + 4 * r;
        lane[0] = o, lane[1] = int8_t(o + 1);
        lane[2] = pairs ? o : int8_t(-1), lane[3] = pairs ? int8_t(o + 1) : int8_t(-1);
      }
  return c;
}
constexpr MultipleControls kMultipleControls = multiple_controls();

// Rows 8h..8h+7 of a 6-bit multiple entry (row r at bits 6r..6r+5 from `bytes`; reads 16 bytes) as
// int32 lanes, or (kPairs) as the int16 pair (m, m) in each lane: vpmaddwd's operand. Each lane's two
// bytes put in place by vpshufb, shifted by the field's bit offset (0, 2, 4 or 6), masked: a pair's
// upper copy, shifted, reaches the lower half only from bit 10 on.
template <bool kPairs>
inline __m256i six_bit_multiples(const uint8_t* bytes, int h) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i control = _mm256_load_si256(reinterpret_cast<const __m256i*>(kMultipleControls.bytes[kPairs][h]));
  const __m256i fields =
      _mm256_srlv_epi32(_mm256_shuffle_epi8(raw, control), _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2));
  return _mm256_and_si256(fields, _mm256_set1_epi32(kPairs ? 0x003F003F : 63));
}

// A one-token tile's weights are read once (gemm_tiled's decode pass): into L2, weight_prefetch's
// distance ahead of the block's lines. The tile steps this pointer along its own, so that each
// prefetch is one instruction at a fixed offset from it (GCC kept one register, then stack slot, per
// line's distance from the weights' pointer instead).
inline const uint8_t* prefetch_start(const PackedGroups& w, const uint8_t* block_lines) {
  return block_lines + weight_prefetch(w, 0, block_lines).distance;
}
inline void prefetch_to_l2(const uint8_t* at) { _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1); }

// The int32 at `p` in every lane, by one load (vbroadcastss).
inline __m256i broadcast_int32(const int32_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// Scale group s's entry e (0: scales, 1: mins) of 16 six-bit multiples, gguf_entry_index's in bytes:
// written so that GCC sees a whole number of entries, and steps a pointer by constants.
inline const uint8_t* six_bit_entry(const uint8_t* multiples, int s, int e) {
  return multiples + size_t(gguf_entry_index(s, e, true) / kGroupRows) * (kGroupRows * 6 / 8);
}

// 8 rows' factors from entry index `index` on (fp16 or fp32: GgufFormat::block's).
inline __m256 factors(const PackedGroups& w, const uint8_t* factor_base, unsigned index) {
  return w.half_factors ? Vec::half_to_float(factor_base + 2 * index)
                        : Vec::loadu_ps(reinterpret_cast<const float*>(factor_base) + index);
}

// Q4_K: one token x 16 rows (gemm_tiled's tile: M = NV = 1).
template <int M, int NV>
struct Q4kTokenTile {
  static_assert(M == 1 && NV == 1);
  static void run(const QuantizedParts<2>* x, const PackedGroups& w, float* y, size_t) {
    const int8_t* parts[2] = {x->part[0].values, x->part[1].values};  // the row, its residual
    const int32_t* starts = x->group_starts;  // -128 x the group's sum(x), 256 x the row's + the residual's
    const uint8_t* multiples = w.scales + w.multiples_at;
    const uint8_t* factor_base = w.scales + w.factors_at;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int blocks = w.k / kGgufBlockInputs;
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* lines = w.values + size_t(b) * kBlockGroups * kGroupLines * 64;
      const uint8_t* ahead = prefetch_start(w, lines);
      const unsigned factor_at = unsigned(gguf_factor_index(b * kBlockGroups, 0, 32, true));
      const __m256 scale_factor[2] = {factors(w, factor_base, factor_at), factors(w, factor_base, factor_at + 8)};
      for (int g = 0; g < kBlockGroups; ++g, lines += kGroupLines * 64, ahead += kGroupLines * 64) {
        const int s = b * kBlockGroups + g, c0 = s * kGroupLines;
        __m256i partial[2][2];  // [row, residual][rows 0-7, 8-15]: int16, 4 lines' products (MaddubsDot)
        for (int l = 0; l < kGroupLines; ++l) {
          prefetch_to_l2(ahead + 64 * l);
          __m256i low[2], high[2];  // the line's inputs 8c..8c+3 and 8c+4..8c+7
          for (int h = 0; h < 2; ++h) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 64 * l + 32 * h));
            low[h] = _mm256_and_si256(raw, low_nibbles);
            high[h] = _mm256_and_si256(_mm256_srli_epi32(raw, 4), low_nibbles);
          }
          for (int p = 0; p < 2; ++p) {
            const __m256i a_low = _mm256_set1_epi32(load_int8_quad(parts[p] + 8 * (c0 + l)));
            const __m256i a_high = _mm256_set1_epi32(load_int8_quad(parts[p] + 8 * (c0 + l) + 4));
            for (int h = 0; h < 2; ++h) {
              const __m256i products =
                  _mm256_add_epi16(_mm256_maddubs_epi16(low[h], a_low), _mm256_maddubs_epi16(high[h], a_high));
              partial[p][h] = l == 0 ? products : _mm256_add_epi16(partial[p][h], products);
            }
          }
          // Each line's products added before the next line's: GCC otherwise ran all 16 vpmaddubsw of
          // a group first and kept their results on the stack (25 spills a group).
          for (int p = 0; p < 2; ++p)
            for (int h = 0; h < 2; ++h) asm("" : "+x"(partial[p][h]));
        }
        // Widened by the multiple m (the row's by 256 m <= 16,128): at most 2 x 30,720 x 16,128 +
        // 2 x 30,720 x 63 < 2^30 in int32. Its fp32 conversion rounds above 2^24 (a relative 6e-8).
        const uint8_t* entry = six_bit_entry(multiples, s, 0);
        for (int h = 0; h < 2; ++h) {
          const __m256i m = six_bit_multiples<true>(entry, h);
          const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(partial[0][h], _mm256_slli_epi16(m, 8)),
                                               _mm256_madd_epi16(partial[1][h], m));
          acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale_factor[h], acc[h]);
        }
      }
      // The block's mins: sum over its groups of the min multiple times sum(x) (at most 8 x 63 x 32 x
      // 32,639 < 2^29), times the min factor; starts hold -128 x sum(x).
      __m256i mins[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int g = 0; g < kBlockGroups; ++g) {
        const int s = b * kBlockGroups + g;
        const __m256i minus_sum = _mm256_srai_epi32(broadcast_int32(starts + s), 7);
        const uint8_t* entry = six_bit_entry(multiples, s, 1);
        for (int h = 0; h < 2; ++h)
          mins[h] = _mm256_add_epi32(mins[h], _mm256_mullo_epi32(six_bit_multiples<false>(entry, h), minus_sum));
        for (int h = 0; h < 2; ++h) asm("" : "+x"(mins[h]));  // as the lines': no decode run ahead and spilled
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 min_factor = factors(w, factor_base, factor_at + kGroupRows + 8 * h);
        acc[h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[h]), min_factor, acc[h]);
      }
    }
    const __m256 x_scale = _mm256_set1_ps(x->part[1].scale * w.scale_factor);
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + 8 * h, _mm256_mul_ps(acc[h], x_scale));
  }
};

// Q6_K: one token x 16 rows. A scale group is one unit of 16 inputs: nibble lines 0 and 1 (quads
// 0, 1 and 2, 3 in their low and high nibbles) and the plane line (quad q's high bits at 2q, 2q + 1).
template <int M, int NV>
struct Q6kTokenTile {
  static_assert(M == 1 && NV == 1);
  static constexpr int kGroups = kGgufBlockInputs / 16, kUnitBytes = 3 * 64;
  static void run(const QuantizedParts<2>* x, const PackedGroups& w, float* y, size_t) {
    const int8_t* parts[2] = {x->part[0].values, x->part[1].values};
    const int32_t* starts = x->group_starts;
    const int8_t* multiples = reinterpret_cast<const int8_t*>(w.scales + w.multiples_at);
    const uint8_t* factor_base = w.scales + w.factors_at;
    const __m256i low_bits = _mm256_set1_epi8(0x0F), high_bits = _mm256_set1_epi8(0x30);
    const float minus_lowest = float(kInt8Offset - int(w.value_offset));
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int blocks = w.k / kGgufBlockInputs;
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* unit = w.values + size_t(b) * kGroups * kUnitBytes;
      const uint8_t* ahead = prefetch_start(w, unit);
      // Per block at most 16 groups x 2 x 2 x 32,256 x 128 < 2^29 in int32: [row, residual][rows 0-7, 8-15].
      __m256i sums[2][2] = {};
      for (int g = 0; g < kGroups; ++g, unit += kUnitBytes, ahead += kUnitBytes) {
        const int s = b * kGroups + g;
        for (int l = 0; l < 3; ++l) prefetch_to_l2(ahead + 64 * l);
        // The 16 rows' multiples as int16 pairs (m, m): rows 0-7 and 8-15, each byte doubled and widened.
        const __m128i m8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(multiples + s * kGroupRows));
        const __m256i m[2] = {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(m8, m8)),
                              _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(m8, m8))};
        for (int line = 0; line < 2; ++line) {  // quads 2 line, 2 line + 1: at most 2 x 2 x 63 x 128 in int16
          __m256i a[2][2];
          for (int p = 0; p < 2; ++p)
            for (int e = 0; e < 2; ++e)
              a[p][e] = _mm256_set1_epi32(load_int8_quad(parts[p] + 16 * s + 4 * (2 * line + e)));
          for (int h = 0; h < 2; ++h) {
            const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64 * line + 32 * h));
            const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 128 + 32 * h));
            const __m256i even_high = line == 0 ? _mm256_slli_epi32(plane, 4) : plane;
            const __m256i odd_high = line == 0 ? _mm256_slli_epi32(plane, 2) : _mm256_srli_epi32(plane, 2);
            const __m256i even =
                _mm256_or_si256(_mm256_and_si256(low, low_bits), _mm256_and_si256(even_high, high_bits));
            const __m256i odd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(low, 4), low_bits),
                                                _mm256_and_si256(odd_high, high_bits));
            for (int p = 0; p < 2; ++p) {
              const __m256i products =
                  _mm256_add_epi16(_mm256_maddubs_epi16(even, a[p][0]), _mm256_maddubs_epi16(odd, a[p][1]));
              sums[p][h] = _mm256_add_epi32(sums[p][h], _mm256_madd_epi16(products, m[h]));
            }
          }
          for (int p = 0; p < 2; ++p)
            for (int h = 0; h < 2; ++h) asm("" : "+x"(sums[p][h]));  // as Q4_K's partials
        }
      }
      // The values' offset: lowest x sum(x) per group, times its multiple (at most 16 x 128 x 16 x
      // 32,639 < 2^31); starts hold -128 x sum(x).
      __m256i offsets[2] = {};
      KT_UNROLL for (int g = 0; g < kGroups; ++g) {
        const int s = b * kGroups + g;
        const __m256i minus_sum = _mm256_srai_epi32(broadcast_int32(starts + s), 7);
        for (int h = 0; h < 2; ++h) {
          const __m256i m = _mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(multiples + s * kGroupRows + 8 * h)));
          offsets[h] = _mm256_add_epi32(offsets[h], _mm256_mullo_epi32(m, minus_sum));
        }
        for (int h = 0; h < 2; ++h) asm("" : "+x"(offsets[h]));  // no group's loads hoisted and spilled
      }
      const unsigned factor_at = unsigned(gguf_factor_index(b * kGroups, 0, 16, false));
      for (int h = 0; h < 2; ++h) {  // the row's sums at 256 x the residual's scale
        const __m256 d = factors(w, factor_base, factor_at + 8 * h);
        const __m256 row = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0][h]), _mm256_set1_ps(256.0f),
                                           _mm256_cvtepi32_ps(sums[1][h]));
        const __m256 offset = _mm256_mul_ps(_mm256_cvtepi32_ps(offsets[h]), _mm256_set1_ps(minus_lowest));
        acc[h] = _mm256_fmadd_ps(_mm256_add_ps(row, offset), d, acc[h]);
      }
    }
    const __m256 x_scale = _mm256_set1_ps(x->part[1].scale * w.scale_factor);
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + 8 * h, _mm256_mul_ps(acc[h], x_scale));
  }
};

// Token t of x through the one-token tile for w's held form, run as gemm_four_bit runs its tiles.
// Not inlined into the loop over tokens: there GCC 12 compiled the tile with 1.7 % more instructions.
template <template <int, int> class Tile, class Format>
[[gnu::noinline]] void gemm_token(const Activations& x, int t, const PackedGroups& w, float* y, size_t y_stride) {
  using Tiles = IntTiles<Vec, MaddubsDot<Vec>, Format>;
  Tiles::template gemm_tokens<Tile, 1, 1, 2>(
      [&](int) { return QuantizedParts<2>{{x.quantized_row(2 * t), x.quantized_row(2 * t + 1)}}; }, 1, w,
      y + 2 * t * y_stride, 2 * y_stride, reinterpret_cast<int32_t*>(x.scratch));
}

// Each token in turn: the second reads the call's rows (at most 74 KB) from L2.
template <template <int, int> class Tile, class Format>
void gemm_token_by_token(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  for (int t = 0; t < x.rows / 2; ++t) gemm_token<Tile, Format>(x, t, w, y, y_stride);
  zero_residual_outputs(x, w, y, y_stride);
}

}  // namespace

bool gemm_gguf_one_token(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  // Up to how many tokens a call takes these tiles, a token at a time, rather than the shared tile of
  // widened tokens (MaddwdDot), which decodes each line once for all of them. Callgrind, 3 layer
  // calls of 8 experts (bench/one_layer.py, forward_worker), millions of instructions, these tiles
  // against the shared: Q4_K at 4 and 5 tokens 150.9 and 188.6 against 160.5 and 188.9; Q6_K at 2
  // and 3 tokens 111.4 and 167.0 against 135.4 and 167.0.
  constexpr int kQ4kTokens = 4, kQ6kTokens = 2;
  if (x.quantized.parts != 2 || !w.factored_scales || w.e4m3_scales || w.k % kGgufBlockInputs != 0) return false;
  const int tokens = x.rows / 2;
  // Q4_K: the values 0..15 (levels 0..15, + 128), 6-bit unsigned multiples of scales and mins.
  if (tokens <= kQ4kTokens && w.levels != nullptr && consecutive_levels(w.levels) &&
      uint8_t(w.levels[0]) == kInt8Offset && w.scale_group == 32 && w.mins && w.multiple_bits == 6 &&
      w.multiple_bias == 0) {
    gemm_token_by_token<Q4kTokenTile, GgufNibbleFormat<Vec>>(x, w, y, y_stride);
    return true;
  }
  // Q6_K: 6-bit value planes, int8 multiples of the scales, no mins.
  if (tokens <= kQ6kTokens && w.levels == nullptr && w.value_bits == 6 && w.scale_group == 16 && !w.mins &&
      w.multiple_bits == 8) {
    gemm_token_by_token<Q6kTokenTile, GgufPlanarFormat<Vec, 6>>(x, w, y, y_stride);
    return true;
  }
  return false;
}

}  // namespace avx2
KT_NAMESPACE_END
