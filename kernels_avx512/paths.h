// Shared by the AVX512 kernel files: which multiply path init_kernels() chose, and the helpers both
// formats use.
#pragma once

// GCC 12 reports its own _mm512_undefined_*() as (maybe-)uninitialized: a header false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "gemm_tiles.h"

KT_NAMESPACE_BEGIN

// True when the CPU has AVX512_BF16 and KT_KERNEL_DISABLE_AVX512_BF16 does not forbid it.
bool use_vdpbf16ps();

// The AVX512 BF16 GEMM; gemm_bf16 of the avx512 build (bf16_entry.cpp), and of the amx build below
// its tile threshold (kernels_amx/).
void gemm_bf16_avx512(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);

// All AVX512_BF16 code, in vdpbf16ps.cpp (the one file compiled with -mavx512bf16); called only
// after CPUID reported AVX512_BF16.
void gemm_bf16_vdpbf16ps(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_mxfp4_vdpbf16ps(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
double dpbf16_peak_probe(int64_t iterations);  // flops done

namespace avx512 {

// bf16 -> fp32 of the even (low half) and odd (high half) element of each 32-bit lane.
inline __m512 even_bf16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_bf16(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

}  // namespace avx512
KT_NAMESPACE_END
