// AVX512 BF16 GEMM without AVX512_BF16: bf16 widened to fp32, plain AVX512F FMA (the vdpbf16ps
// path is vdpbf16ps.cpp).
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// Register blocking: rows x 16-column groups held in zmm accumulators (of 32 registers).
constexpr int kFmaRows = 4, kFmaGroups = 4;  // 16 accumulators + 8 decoded weight vectors

template <int M, int NV>
struct FmaTile {
  static void run(const bf16_t* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const bf16_t* values = reinterpret_cast<const bf16_t*>(w.values);
    const size_t group_elems = w.group_bytes / sizeof(bf16_t);
    __m512 acc[M][NV];
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < round_up(w.k, 2) / 2; ++p) {
      __m512 w_even[NV], w_odd[NV];
      for (int j = 0; j < NV; ++j) {
        const bf16_t* line_start = values + j * group_elems + size_t(p) * 2 * kGroupRows;
        prefetch_weights(w, reinterpret_cast<const uint8_t*>(line_start));
        const __m512i line = _mm512_load_si512(line_start);
        w_even[j] = even_bf16(line);
        w_odd[j] = odd_bf16(line);
      }
      for (int i = 0; i < M; ++i) {
        const __m512i xv = _mm512_set1_epi32(load_bf16_pair(x[i] + 2 * p));
        const __m512 x_even = even_bf16(xv), x_odd = odd_bf16(xv);
        for (int j = 0; j < NV; ++j) {
          acc[i][j] = _mm512_fmadd_ps(x_even, w_even[j], acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(x_odd, w_odd[j], acc[i][j]);
        }
      }
    }
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(y + i * y_stride + j * kGroupRows, acc[i][j]);
  }
};

// FP8 (fp8_tiles.h): decoded weight lines widened like the BF16 ones.
struct FmaFp8 : Vec {
  using Row = const bf16_t*;
  struct Line {
    __m512 even, odd;
  };
  using Act = Line;
  using Bits = __m512i;
  static Bits decode_bits(const uint8_t* codes) { return decode_fp8_line<>(codes); }
  static Bits load_bits(const bf16_t* line) { return _mm512_load_si512(line); }
  static void store_bits(bf16_t* line, Bits bits) { _mm512_store_si512(line, bits); }
  static Line line_of(Bits pairs) { return {even_bf16(pairs), odd_bf16(pairs)}; }
  static Act act(Row x, int p) { return line_of(_mm512_set1_epi32(load_bf16_pair(x + 2 * p))); }
  static Float dot(Float acc, const Line& w, const Act& a) {
    return _mm512_fmadd_ps(a.odd, w.odd, _mm512_fmadd_ps(a.even, w.even, acc));
  }
};

}  // namespace

void gemm_fp8_fma(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_fp8<FmaFp8, 4, 2, kFmaRows, kFmaGroups>([&](int i) { return x.row(i); }, x.rows, w, y, y_stride);
}

void gemm_bf16_fma(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<FmaTile, kFmaRows, kFmaGroups>(x, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
