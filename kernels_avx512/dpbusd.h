// The vpdpbusd dot product of the integer tiles and the 4-bit tiles' shapes, for the files compiled
// with -mavx512vnni (vpdpbusd.cpp, mxfp4_vbmi.cpp). In an unnamed namespace: each of those files,
// compiled with its own ISA flags, keeps its own copy.
#pragma once

#include "int_tiles.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// INT4 and MXFP4: 12 integer + 12 float accumulators + 4 decoded lines
constexpr int kInt4Rows = 6, kInt4Groups = 2;
// Decode (one or two rows): each accumulator takes two dependent vpdpbusd per line, so a 6x2 tile's
// one row has two chains (INT4 from cache, one core: 32-45 GB/s); four groups per tile: 62-64 GB/s.
constexpr int kFewRows = 2, kFewRowsGroups = 4;
struct DpbusdDot : SumsInPlace<DpbusdDot, __m512i> {
  static constexpr int kQuadsPerSum = kInt8ActivationQuadsPerSum;
  using Weights = __m512i;
  using Act = __m512i;
  static Weights weights(__m512i line) { return line; }
  static Act activation(const int8_t* values, int j) { return _mm512_set1_epi32(load_int8_quad(values + 4 * j)); }
  // acc += w (u8) . a (s8). Inline asm keeps each accumulator in its register: with the intrinsic,
  // GCC 12 copies accumulators around and spills them to the stack every iteration (measured: the
  // INT8 tile ran at 30-40 % of the vpdpbusd peak).
  static __m512i dot(__m512i acc, Weights w, Act a) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
    return acc;
  }
};

// Rows and their residuals (exact activations): tokens of two rows, four tokens x two groups.
constexpr int kPairTokens = 4, kPairGroups = 2;

template <class FourBit>
void gemm_four_bit(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  using Tiles = IntTiles<Vec, DpbusdDot, FourBit>;
  if (x.rows <= kFewRows)
    Tiles::template gemm_four_bit_rows<kFewRows, kFewRowsGroups>(x, w, y, y_stride);
  else
    Tiles::template gemm_four_bit<kInt4Rows, kInt4Groups, kPairTokens, kPairGroups>(x, w, y, y_stride);
}

}  // namespace
}  // namespace avx512
KT_NAMESPACE_END
