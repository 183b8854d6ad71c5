// AVX512 BF16 GEMM: vdpbf16ps when the CPU has AVX512_BF16, plain AVX512F fp32 FMA otherwise.
// The path is chosen once in init_kernels(); KT_KERNEL_DISABLE_AVX512_BF16=1 forces the plain path
// (used by the tests to cover both on one machine).
// GCC 12 reports its own _mm512_undefined_epi32() as maybe-uninitialized (a header false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "cpu_features.h"
#include "gemm_tiles.h"

KT_NAMESPACE_BEGIN
namespace {

// Register blocking: rows x 16-column groups held in zmm accumulators (of 32 registers).
constexpr int kDpRows = 6, kDpGroups = 4;    // 24 accumulators + 4 weight lines
constexpr int kFmaRows = 4, kFmaGroups = 4;  // 16 accumulators + 8 decoded weight vectors

bool use_dpbf16 = false;  // constant-initialised: no code runs at load time

#define KT_TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int M, int NV>
struct DpBf16Tile {
  KT_TARGET_AVX512BF16 static void run(const bf16_t* const* x, const bf16_t* w, size_t group_elems,
                                       int k_pairs, float* y, size_t y_stride) {
    __m512 acc[M][NV];
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < k_pairs; ++p) {
      __m512bh wv[NV];
      for (int j = 0; j < NV; ++j)
        wv[j] = (__m512bh)_mm512_load_si512(w + j * group_elems + size_t(p) * 2 * kGroupRows);
      for (int i = 0; i < M; ++i) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_bf16_pair(x[i] + 2 * p));
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(y + i * y_stride + j * kGroupRows, acc[i][j]);
  }
};

// bf16 -> fp32 of the even (low half) and odd (high half) element of each 32-bit lane.
inline __m512 even_bf16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_bf16(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

template <int M, int NV>
struct FmaTile {
  static void run(const bf16_t* const* x, const bf16_t* w, size_t group_elems, int k_pairs, float* y,
                  size_t y_stride) {
    __m512 acc[M][NV];
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < k_pairs; ++p) {
      __m512 w_even[NV], w_odd[NV];
      for (int j = 0; j < NV; ++j) {
        const __m512i line = _mm512_load_si512(w + j * group_elems + size_t(p) * 2 * kGroupRows);
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

}  // namespace

void init_kernels() {
  const char* disable = std::getenv("KT_KERNEL_DISABLE_AVX512_BF16");
  const bool disabled = disable != nullptr && disable[0] != '\0' && std::strcmp(disable, "0") != 0;
  use_dpbf16 = detect_cpu_features().avx512_bf16 && !disabled;
}

KernelInfo kernel_info() {
  return {"avx512", use_dpbf16 ? "avx512_bf16 (vdpbf16ps)" : "avx512f (bf16->fp32, fma)"};
}

void gemm_bf16(const bf16_t* x, size_t x_stride, const int32_t* row_ids, int m, const bf16_t* packed,
               int k, int groups, float* y, size_t y_stride) {
  if (use_dpbf16)
    gemm_tiled<DpBf16Tile, kDpRows, kDpGroups>(x, x_stride, row_ids, m, packed, k, groups, y, y_stride);
  else
    gemm_tiled<FmaTile, kFmaRows, kFmaGroups>(x, x_stride, row_ids, m, packed, k, groups, y, y_stride);
}

KT_NAMESPACE_END
