// AVX2 BF16 GEMM: fp32 FMA on weights widened from bf16 by a shift / mask. Compiled with
// -mavx2 -mfma -mf16c only: no AVX512 instruction may appear in this build.
#include "fma_group.h"

KT_NAMESPACE_BEGIN
namespace avx2 {
namespace {

// Decode calls (one or two rows per expert) take two groups per tile instead, so they still have
// 4-8 accumulators.
constexpr int kFewRows = 2, kFewRowsGroups = 2;

// x: fp32 rows (widened once per call), readable up to round_up(k, 2).
template <int M, int NV>
struct FmaTile {
  static void run(const float* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const bf16_t* values = reinterpret_cast<const bf16_t*>(w.values);
    const size_t group_elems = w.group_bytes / sizeof(bf16_t);
    __m256 acc[M][2 * NV];  // row i, group g: acc[i][2g], acc[i][2g + 1]
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 2 * NV; ++v) acc[i][v] = _mm256_setzero_ps();
    const int pairs = round_up(w.k, 2) / 2;  // >= 1
    int p = 0;
    do {  // (a do-while: with a for loop GCC 12 keeps a stack copy of every accumulator up to date)
#pragma GCC unroll 4
      for (int g = 0; g < NV; ++g) {
        const bf16_t* line = values + g * group_elems + size_t(p) * 2 * kGroupRows;
        prefetch_weights(w, g, reinterpret_cast<const uint8_t*>(line));
        GroupPair pair;
        for (int h = 0; h < 2; ++h) {
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(line + 16 * h));
          pair.even[h] = even_bf16(wv);
          pair.odd[h] = odd_bf16(wv);
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i) fma_group(acc[i][2 * g], acc[i][2 * g + 1], x[i] + 2 * p, pair);
      }
    } while (++p < pairs);
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 2 * NV; ++v) _mm256_storeu_ps(y + i * y_stride + v * 8, acc[i][v]);
  }
};

}  // namespace

void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const WidenedRows row = widen_rows(x, w.k);
  if (x.rows <= kFewRows)
    gemm_tiled<FmaTile, kFewRows, kFewRowsGroups, const float*>(row, x.rows, w, y, y_stride);
  else
    gemm_tiled<FmaTile, kFmaRows, kFmaGroups, const float*>(row, x.rows, w, y, y_stride);
}

}  // namespace avx2
KT_NAMESPACE_END
