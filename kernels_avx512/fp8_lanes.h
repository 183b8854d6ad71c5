// The FP8 GEMM on fp32 FMA (gemm_fp8.cpp, fp8_vbmi.cpp). Calls of a few rows (decode) decode the
// codes in place, four weights per 32-bit lane, without the byte-to-word widening of
// decode_fp8_line: that widening is a shuffle, and on the Xeon VM this CPU's one 512-bit shuffle
// port bound the decode (one core, a one-row GEMV with K = 2,048 over 128 MiB: 17 -> 21 Gweights/s).
//
// A 64-byte load holds input pairs p and p + 1 of a group (kernels.h): lane l (0-15) holds rows
// 2(l % 8) and 2(l % 8) + 1 at inputs 2p' and 2p' + 1, p' = p + l / 8, one byte each (row-major).
// Byte b, moved to the top 16 bits of the lane and shifted right by 4 (arithmetically), has its
// sign at bit 31 and its exponent and mantissa at bits 26-20; keeping those bits and setting bit 30
// gives the fp32 of 2^8 times a normal code (exponent 128 + e where the code's value has 120 + e:
// so the bias is one bit). Bytes 0 and 1 are even rows, 2 and 3 odd ones; bytes 0 and 2 take
// activation x[2p'], bytes 1 and 3 x[2p' + 1]: two values per vector, lanes 0-7 and 8-15. So each
// row of a group has two accumulators (even and odd rows), each the sum of two halves (pairs p and
// p + 1), put together once per call. A line with a zero or subnormal code goes through Exact (a
// decode_fp8_line_* of vec.h) and a permute.
#pragma once

#include <array>

#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {

template <__m512i (*Exact)(__m256i)>
struct Fp8LaneTiles {
  // Lanes' top bits -> fp32 of 2^8 x the code there: sign, exponent and mantissa kept, bit 30 set.
  static __m512 weights_at_top(__m512i lanes) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(lanes, _mm512_set1_epi32(int32_t(0x87F00000u)),
                                                         _mm512_set1_epi32(0x40000000), 0xEA));  // a & b | c
  }

  // weights[b]: byte b of every lane, 2^8 x its value.
  static void decode_normal(__m512i line, __m512 (&weights)[4]) {
    const __m512i odd_bytes = _mm512_srai_epi16(line, 4);  // bytes 1 and 3 at the top of 16 bits
    const __m512i even_bytes = _mm512_srai_epi16(_mm512_slli_epi16(line, 8), 4);
    weights[0] = weights_at_top(_mm512_slli_epi32(even_bytes, 16));
    weights[1] = weights_at_top(_mm512_slli_epi32(odd_bytes, 16));
    weights[2] = weights_at_top(even_bytes);
    weights[3] = weights_at_top(odd_bytes);
  }

  // The same from Exact's bf16 of each pair (the second pair zero where `second` is null):
  // weights[b] lane l <- bf16 element 4(l % 8) + b of pair l / 8, widened, times 2^8.
  static void decode_exact(const uint8_t* first, const uint8_t* second, __m512 (&weights)[4]) {
    static constexpr std::array<std::array<int16_t, 32>, 4> kIndex = [] {
      std::array<std::array<int16_t, 32>, 4> index{};
      for (int b = 0; b < 4; ++b)
        for (int e = 0; e < 32; ++e) index[b][e] = int16_t((e / 16) * 32 + 4 * (e / 2 % 8) + b);
      return index;
    }();
    const __m512i pair0 = Exact(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first)));
    const __m512i pair1 =
        second != nullptr ? Exact(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second))) : _mm512_setzero_si512();
    for (int b = 0; b < 4; ++b) {
      const __m512i index = _mm512_loadu_si512(kIndex[b].data());
      weights[b] = _mm512_mul_ps(odd_bf16(_mm512_permutex2var_epi16(pair0, index, pair1)), _mm512_set1_ps(256.0f));
    }
  }

  template <int M, int NV>
  struct Tile {
    // sums[i][v][0 / 1]: row i's even / odd rows of group v over pairs p (and p + 1 unless kLast).
    template <bool kLast>
    static void step(const float* const* x, const PackedGroups& w, int p, __m512 (&sums)[M][NV][2]) {
      __m512 act[M][2];  // lanes 0-7: x[2p + b], lanes 8-15: x[2p + 2 + b] (zero for the last pair)
      for (int i = 0; i < M; ++i)
        for (int b = 0; b < 2; ++b) {
          const float* a = x[i] + 2 * p + b;
          act[i][b] = kLast ? _mm512_maskz_mov_ps(0x00FF, _mm512_set1_ps(a[0]))
                            : _mm512_mask_broadcastss_ps(_mm512_set1_ps(a[0]), 0xFF00, _mm_load_ss(a + 2));
        }
      for (int v = 0; v < NV; ++v) {
        const uint8_t* line = w.values + v * w.group_bytes + size_t(p) * 2 * kGroupRows;
        prefetch_weights(w, v, line);
        // The last pair of a group: its 32 bytes and zero codes.
        const __m512i codes = kLast ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, line) : _mm512_loadu_si512(line);
        __m512 weights[4];
        if (__builtin_expect(_mm512_testn_epi8_mask(codes, _mm512_set1_epi8(0x78)) != 0, 0))
          decode_exact(line, kLast ? nullptr : line + 2 * kGroupRows, weights);
        else
          decode_normal(codes, weights);
        for (int i = 0; i < M; ++i) {
          sums[i][v][0] = _mm512_fmadd_ps(weights[1], act[i][1], _mm512_fmadd_ps(weights[0], act[i][0], sums[i][v][0]));
          sums[i][v][1] = _mm512_fmadd_ps(weights[3], act[i][1], _mm512_fmadd_ps(weights[2], act[i][0], sums[i][v][1]));
        }
      }
    }

    static void run(const float* const* x, const PackedGroups& w, float* y, size_t y_stride) {
      static_assert(kFp8Block % 4 == 0, "a scale block must be whole 64-byte lines");
      const int pairs = round_up(w.k, 2) / 2;
      const int block_pairs = w.scale_group > 0 ? w.scale_group / 2 : pairs;
      __m512 acc[M][NV][2];
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v][0] = acc[i][v][1] = _mm512_setzero_ps();
      for (int p0 = 0, block = 0; p0 < pairs; p0 += block_pairs, ++block) {
        const int p1 = std::min(pairs, p0 + block_pairs);
        __m512 sums[M][NV][2];
        for (int i = 0; i < M; ++i)
          for (int v = 0; v < NV; ++v) sums[i][v][0] = sums[i][v][1] = _mm512_setzero_ps();
        int p = p0;
        for (; p + 1 < p1; p += 2) step<false>(x, w, p, sums);
        if (p < p1) step<true>(x, w, p, sums);
        // The row scales in the lanes' order, times 2^-8 (the decoded weights' factor).
        const __m512i even_rows = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
        const __m512i odd_rows = _mm512_add_epi32(even_rows, _mm512_set1_epi32(1));
        for (int v = 0; v < NV; ++v) {
          const __m512 scales = _mm512_mul_ps(
              _mm512_load_ps(reinterpret_cast<const float*>(w.scales + v * w.group_scale_bytes) + block * kGroupRows),
              _mm512_set1_ps(1.0f / 256));
          const __m512 even_scales = _mm512_permutexvar_ps(even_rows, scales);
          const __m512 odd_scales = _mm512_permutexvar_ps(odd_rows, scales);
          for (int i = 0; i < M; ++i) {
            acc[i][v][0] = _mm512_fmadd_ps(sums[i][v][0], even_scales, acc[i][v][0]);
            acc[i][v][1] = _mm512_fmadd_ps(sums[i][v][1], odd_scales, acc[i][v][1]);
          }
        }
      }
      // Row 2r = lane r + lane r + 8 of the even accumulator, row 2r + 1 the same of the odd one.
      const __m512i first_halves = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i second_halves = _mm512_add_epi32(first_halves, _mm512_set1_epi32(8));
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < NV; ++v)
          _mm512_storeu_ps(y + i * y_stride + v * kGroupRows,
                           _mm512_add_ps(_mm512_permutex2var_ps(acc[i][v][0], first_halves, acc[i][v][1]),
                                         _mm512_permutex2var_ps(acc[i][v][0], second_halves, acc[i][v][1])));
    }
  };
};

// The FP8 GEMM on fp32 FMA, on x's rows widened: up to four rows by the lane tiles above, more by
// the stack driver of fp8_tiles.h with decode_fp8_line (its first tile of rows decodes each code
// once for all). Exact: the decoder of lines with a zero or subnormal code.
template <__m512i (*Exact)(__m256i)>
void gemm_fp8_on_widened_rows(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const WidenedRows rows = widen_rows(x, w.k);
  if (x.rows <= 4)
    gemm_tiled<Fp8LaneTiles<Exact>::template Tile, 4, 2, const float*>(rows, x.rows, w, y, y_stride);
  else
    gemm_lines_on_stack<FmaFp8<decode_fp8_line<Exact>>, kFmaRows, kFmaGroups>(rows, x.rows, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
