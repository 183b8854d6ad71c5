// AVX512 BF16 GEMM without AVX512_BF16: bf16 widened to fp32, plain AVX512F FMA (the vdpbf16ps
// path is vdpbf16ps.cpp).
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// x: rows widened to fp32 (widen_rows). Its row loops are unrolled (KT_UNROLL; one core, 768 x 2048
// in cache, 32 rows: 98 -> 130 GFLOP/s).
template <int M, int NV>
struct FmaTile {
  static void run(const float* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const bf16_t* values = reinterpret_cast<const bf16_t*>(w.values);
    const size_t group_elems = w.group_bytes / sizeof(bf16_t);
    __m512 acc[M][NV];
    KT_UNROLL
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < round_up(w.k, 2) / 2; ++p) {
      __m512 w_even[NV], w_odd[NV];
      for (int j = 0; j < NV; ++j) {
        const bf16_t* line_start = values + j * group_elems + size_t(p) * 2 * kGroupRows;
        prefetch_weights(w, j, reinterpret_cast<const uint8_t*>(line_start));
        const __m512i line = _mm512_load_si512(line_start);
        w_even[j] = even_bf16(line);
        w_odd[j] = odd_bf16(line);
      }
      KT_UNROLL
      for (int i = 0; i < M; ++i) {
        const __m512 x_even = _mm512_set1_ps(x[i][2 * p]), x_odd = _mm512_set1_ps(x[i][2 * p + 1]);
        for (int j = 0; j < NV; ++j) {
          acc[i][j] = _mm512_fmadd_ps(x_even, w_even[j], acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(x_odd, w_odd[j], acc[i][j]);
        }
      }
    }
    KT_UNROLL
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(y + i * y_stride + j * kGroupRows, acc[i][j]);
  }
};

}  // namespace

// From 32 rows: through the stack (fp8_tiles.h), where the first tile of rows leaves each line
// widened to fp32 for the others. One core, 768 x 2048 in cache, GFLOP/s, FmaTile -> the stack:
// 128 rows 131 -> 150, 64 rows 130 -> 144, 32 rows 129 -> 133, 16 rows 126 -> 108-117 (the stack
// adds each 128-input block's sums to y, and its first tile stores every line).
constexpr int kBf16StackRows = 32;

void gemm_bf16_fma(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const WidenedRows rows = widen_rows(x, w.k);
  if (x.rows < kBf16StackRows)
    gemm_tiled<FmaTile, kFmaRows, kFmaGroups, const float*>(rows, x.rows, w, y, y_stride);
  else
    gemm_lines_on_stack<FmaBf16, kFmaRows, kFmaGroups>(rows, x.rows, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
