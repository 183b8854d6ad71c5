// AVX512 BF16 GEMM: the vdpbf16ps path where the CPU has AVX512_BF16 (vdpbf16ps.cpp), else plain
// AVX512F fp32 FMA here. Also the start-up choice between the two.
#include <cstdlib>
#include <cstring>

#include "cpu_features.h"
#include "paths.h"

KT_NAMESPACE_BEGIN
namespace {

using avx512::even_bf16;
using avx512::odd_bf16;

// Register blocking: rows x 16-column groups held in zmm accumulators (of 32 registers).
constexpr int kFmaRows = 4, kFmaGroups = 4;  // 16 accumulators + 8 decoded weight vectors

// Constant-initialised (no code runs at load time); set once by init_kernels().
bool vdpbf16ps_enabled = false, vpdpbusd_enabled = false;

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

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

}  // namespace

// KT_KERNEL_DISABLE_AVX512_BF16=1 / KT_KERNEL_DISABLE_AVX512_VNNI=1 force the plain paths (the
// tests cover both on one machine).
void init_kernels() {
  const CpuFeatures cpu = detect_cpu_features();
  vdpbf16ps_enabled = cpu.avx512_bf16 && !env_flag("KT_KERNEL_DISABLE_AVX512_BF16");
  vpdpbusd_enabled = cpu.avx512_vnni && !env_flag("KT_KERNEL_DISABLE_AVX512_VNNI");
}

bool use_vdpbf16ps() { return vdpbf16ps_enabled; }
bool use_vpdpbusd() { return vpdpbusd_enabled; }

KernelInfo kernel_info() {
  return {"avx512", vdpbf16ps_enabled ? "avx512_bf16 (vdpbf16ps)" : "avx512f (bf16->fp32, fma)",
          vpdpbusd_enabled ? "E2M1 -> integers by vpshufb, int8 activations, avx512_vnni (vpdpbusd)"
                           : "E2M1 -> integers by vpshufb, int8 activations, avx512bw (vpmaddubsw)",
          vpdpbusd_enabled ? "avx512_vnni (vpdpbusd)" : "avx512bw (vpmaddwd / vpmaddubsw)"};
}

void gemm_bf16_avx512(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (vdpbf16ps_enabled)
    gemm_bf16_vdpbf16ps(x, w, y, y_stride);
  else
    gemm_tiled<FmaTile, kFmaRows, kFmaGroups>(x, w, y, y_stride);
}

KT_NAMESPACE_END
