// AVX2 BF16 GEMM: bf16 widened to fp32 with a shift / mask, fp32 FMA. Compiled with
// -mavx2 -mfma -mf16c only: no AVX512 instruction may appear in this build.
#include "bf16_pairs.h"

KT_NAMESPACE_BEGIN
namespace {

using avx2::even_bf16;
using avx2::odd_bf16;

// 2 rows x 2 groups (= 4 ymm column vectors) -> 8 accumulators; 16 ymm registers in all.
constexpr int kRows = 2, kGroups = 2;
constexpr int kVecsPerGroup = kGroupRows / 8;

template <int M, int NV>
struct FmaTile {
  static constexpr int kVecs = NV * kVecsPerGroup;
  static void run(const bf16_t* const* x, const PackedGroups& w, float* y, size_t y_stride) {
    const bf16_t* values = reinterpret_cast<const bf16_t*>(w.values);
    const size_t group_elems = w.group_bytes / sizeof(bf16_t);
    __m256 acc[M][kVecs];
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm256_setzero_ps();
    for (int p = 0; p < round_up(w.k, 2) / 2; ++p) {
      __m256 x_even[M], x_odd[M];
      for (int i = 0; i < M; ++i) {
        const __m256i xv = _mm256_set1_epi32(load_bf16_pair(x[i] + 2 * p));
        x_even[i] = even_bf16(xv);
        x_odd[i] = odd_bf16(xv);
      }
      for (int v = 0; v < kVecs; ++v) {
        const bf16_t* line = values + (v / kVecsPerGroup) * group_elems + size_t(p) * 2 * kGroupRows +
                             (v % kVecsPerGroup) * 16;
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(line));
        const __m256 w_even = even_bf16(wv), w_odd = odd_bf16(wv);
        for (int i = 0; i < M; ++i) {
          acc[i][v] = _mm256_fmadd_ps(x_even[i], w_even, acc[i][v]);
          acc[i][v] = _mm256_fmadd_ps(x_odd[i], w_odd, acc[i][v]);
        }
      }
    }
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(y + i * y_stride + v * 8, acc[i][v]);
  }
};

}  // namespace

void init_kernels() {}

KernelInfo kernel_info() {
  return {"avx2", "avx2 (bf16->fp32, fma)", "avx2 (E2M1 -> integers by vpshufb, int8 activations, vpmaddubsw)",
          "avx2 (vpmaddwd / vpmaddubsw)"};
}

void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<FmaTile, kRows, kGroups>(x, w, y, y_stride);
}

KT_NAMESPACE_END
