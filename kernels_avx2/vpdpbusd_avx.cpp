// Everything that executes AVX-VNNI instructions (vpdpbusd, VEX-encoded, on ymm): this file alone is
// compiled with -mavxvnni (CMakeLists.txt), and its functions run only after CPUID reported AVX-VNNI
// (entry.cpp). Intel's client CPUs since Alder Lake have it and no AVX512: the avx2 build is theirs.
// The integer tiles of kernels_common/int_tiles.h, as the avx512 build's vpdpbusd.cpp runs them on zmm.
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx2 {
namespace {

struct DpbusdAvxDot : SumsInPlace<DpbusdAvxDot, __m256i> {
  static constexpr int kQuadsPerSum = kInt8ActivationQuadsPerSum;
  using Weights = __m256i;
  using Act = __m256i;
  static Weights weights(__m256i line) { return line; }
  static Act activation(const int8_t* values, int j) { return _mm256_set1_epi32(load_int8_quad(values + 4 * j)); }
  // acc += w (u8) . a (s8). Inline asm, as in the avx512 build: each accumulator stays in its
  // register. {vex} (written %{vex%} in asm): the AVX-VNNI encoding (the EVEX one is AVX512_VNNI's).
  static __m256i dot(__m256i acc, Weights w, Act a) {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(a));
    return acc;
  }
};

// 16 ymm: a 16-row group is two. INT8: 6 rows x 1 group = 12 accumulators + 2 lines + the
// broadcast activation. 4-bit: int32 sums and fp32 results per row, 2 rows x 1 group; a row and its
// residual as one token, 2 tokens.
constexpr int kInt8Rows = 6, kFourBitRows = 2, kPairTokens = 2;
volatile int probe_sink;  // keeps the peak probe's loop from being optimised away

template <class FourBit>
void gemm_four_bit(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  IntTiles<Vec, DpbusdAvxDot, FourBit>::template gemm_four_bit<kFourBitRows, 1, kPairTokens, 1>(x, w, y, y_stride);
}

}  // namespace

void gemm_int8_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled_quantized<IntTiles<Vec, DpbusdAvxDot>::Int8, kInt8Rows, 1>(x, w, y, y_stride);
}

void gemm_int4_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Int4Format<Vec>>(x, w, y, y_stride);
}

void gemm_mxfp4_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Mxfp4Format<Vec>>(x, w, y, y_stride);
}

void gemm_gguf_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  for_gguf_values<Vec>(w, [&]<class Format>(const PackedGroups& held) { gemm_four_bit<Format>(x, held, y, y_stride); });
}

double dpbusd_avx_peak_probe(int64_t iterations) {
  constexpr int kChains = 12;  // enough independent accumulators to hide the latency
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
  const __m256i a = _mm256_set1_epi32(0x01010101), b = _mm256_set1_epi32(0x01010101);
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = DpbusdAvxDot::dot(acc[c], a, b);
  __m256i sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_epi32(sum, acc[c]);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  probe_sink = lanes[0];
  return double(iterations) * kChains * 8 * 4 * 2;
}

}  // namespace avx2
KT_NAMESPACE_END
