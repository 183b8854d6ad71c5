// Everything that executes AVX512_BF16 instructions: this file alone is compiled with -mavx512bf16
// (CMakeLists.txt), and its functions run only after CPUID reported AVX512_BF16 (paths.cpp).
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// BF16: rows x 16-column groups of accumulators (kDpRows x kDpGroups), weight lines used straight
// as vdpbf16ps operands.
volatile float probe_sink;                 // keeps the peak probe's loop from being optimised away

template <int M, int NV>
struct DpBf16Tile {
  static void run(const bf16_t* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const bf16_t* values = reinterpret_cast<const bf16_t*>(w.values);
    const size_t group_elems = w.group_bytes / sizeof(bf16_t);
    __m512 acc[M][NV];
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < round_up(w.k, 2) / 2; ++p) {
      __m512bh wv[NV];
      for (int j = 0; j < NV; ++j) {
        const bf16_t* line = values + j * group_elems + size_t(p) * 2 * kGroupRows;
        prefetch_weights(w, j, reinterpret_cast<const uint8_t*>(line));
        wv[j] = (__m512bh)_mm512_load_si512(line);
      }
      for (int i = 0; i < M; ++i) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_bf16_pair(x[i] + 2 * p));
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(y + i * y_stride + j * kGroupRows, acc[i][j]);
  }
};

}  // namespace

void gemm_fp8_vdpbf16ps(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_fp8<DpBf16Fp8<decode_fp8_line<>>, 4, 2, kDpRows, kDpGroups>([&](int i) { return x.row(i); }, x.rows, w, y, y_stride);
}

void gemm_bf16_vdpbf16ps(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<DpBf16Tile, kDpRows, kDpGroups>(x, w, y, y_stride);
}

double dpbf16_peak_probe(int64_t iterations) {
  constexpr int kChains = 12;  // enough independent accumulators to hide the latency
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(float(c));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x3F803F80);
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  probe_sink = _mm512_reduce_add_ps(sum);
  return double(iterations) * kChains * 16 * 2 * 2;
}

}  // namespace avx512
KT_NAMESPACE_END
