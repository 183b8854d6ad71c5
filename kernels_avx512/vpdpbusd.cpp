// Everything that executes AVX512_VNNI instructions: this file alone is compiled with -mavx512vnni
// (CMakeLists.txt), and its functions run only after CPUID reported AVX512_VNNI (paths.cpp).
#include "int_tiles.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

constexpr int kInt8Rows = 6, kInt8Groups = 4;  // 24 accumulators + 4 weight lines
// INT4 and MXFP4: 12 integer + 12 float accumulators + 4 decoded lines
constexpr int kInt4Rows = 6, kInt4Groups = 2;
// Decode (one or two rows): each accumulator takes two dependent vpdpbusd per line, so a 6x2 tile's
// one row has two chains (INT4 from cache, one core: 32-45 GB/s); four groups per tile: 62-64 GB/s.
constexpr int kFewRows = 2, kFewRowsGroups = 4;
volatile int probe_sink;                       // keeps the peak probe's loop from being optimised away

struct DpbusdDot {
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
  static __m512i dot2(__m512i acc, Weights w1, Act a1, Weights w2, Act a2) { return dot(dot(acc, w1, a1), w2, a2); }
};

using Tiles = IntTiles<Vec, DpbusdDot>;

template <template <int, int> class Tile>
void gemm_four_bit(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (x.rows <= kFewRows)
    gemm_tiled_quantized<Tile, kFewRows, kFewRowsGroups>(x, w, y, y_stride);
  else
    gemm_tiled_quantized<Tile, kInt4Rows, kInt4Groups>(x, w, y, y_stride);
}

}  // namespace

void gemm_int8_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_quantized<Tiles::Int8, kInt8Rows, kInt8Groups>(x, w, y, y_stride);
}

void gemm_int4_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Tiles::FourBitTile>(x, w, y, y_stride);
}

void gemm_mxfp4_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<IntTiles<Vec, DpbusdDot, Mxfp4Format<Vec>>::FourBitTile>(x, w, y, y_stride);
}

double dpbusd_peak_probe(int64_t iterations) {
  constexpr int kChains = 12;  // enough independent accumulators to hide the latency
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  const __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x01010101);
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  __m512i sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[c]);
  probe_sink = _mm512_reduce_add_epi32(sum);
  return double(iterations) * kChains * 16 * 4 * 2;
}

}  // namespace avx512
KT_NAMESPACE_END
