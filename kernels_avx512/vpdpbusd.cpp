// Everything that executes AVX512_VNNI instructions: this file alone is compiled with -mavx512vnni
// (CMakeLists.txt), and its functions run only after CPUID reported AVX512_VNNI (paths.cpp).
#include "dpbusd.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

constexpr int kInt8Rows = 6, kInt8Groups = 4;  // 24 accumulators + 4 weight lines
volatile int probe_sink;                       // keeps the peak probe's loop from being optimised away

using Tiles = IntTiles<Vec, DpbusdDot>;

}  // namespace

void gemm_int8_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_quantized<Tiles::Int8, kInt8Rows, kInt8Groups>(x, w, y, y_stride);
}

void gemm_int4_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Int4Format<Vec>>(x, w, y, y_stride);
}

void gemm_mxfp4_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Mxfp4Format<Vec>>(x, w, y, y_stride);
}

void gemm_gguf_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  for_gguf_values<Vec>(w, [&]<class Format>(const PackedGroups& held) { gemm_four_bit<Format>(x, held, y, y_stride); });
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
