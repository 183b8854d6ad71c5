// FP8 on CPUs with AVX512_VBMI: lines with a zero or subnormal code are decoded by two
// 128-entry byte lookups (vpermi2b: the low and the high byte of the magnitude's bf16) and the sign
// bit, five instructions per 32 codes where the exact arithmetic decoder of vec.h takes nine. Lines
// of normal codes take vec.h's shortcut, faster still (one core, codes in cache: 27 -> 32 Gweights/s
// against the lookups for every line). This file alone is compiled with -mavx512vbmi and
// -mavx512bf16 (CMakeLists.txt); paths.cpp calls its vdpbf16ps GEMM only after CPUID reported both,
// its FMA GEMM after it reported AVX512_VBMI.
#include <array>

#include "fp8_lanes.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// Byte b of the table: the low (kHigh = false) or high byte of fp8_magnitude_bf16(b), b < 128.
template <bool kHigh>
constexpr std::array<uint8_t, 128> magnitude_bytes() {
  std::array<uint8_t, 128> bytes{};
  for (int m = 0; m < 128; ++m) bytes[m] = uint8_t(fp8_magnitude_bf16(m) >> (kHigh ? 8 : 0));
  return bytes;
}
alignas(64) constexpr std::array<uint8_t, 128> kLowBytes = magnitude_bytes<false>();
alignas(64) constexpr std::array<uint8_t, 128> kHighBytes = magnitude_bytes<true>();

// Byte 2i and 2i + 1 <- code i: each 16-bit lane holds its code twice, as the lookups' index.
__m512i code_pairs() {
  alignas(64) static constexpr std::array<uint8_t, 64> kIndex = [] {
    std::array<uint8_t, 64> index{};
    for (int i = 0; i < 64; ++i) index[i] = uint8_t(i / 2);
    return index;
  }();
  return _mm512_load_si512(kIndex.data());
}

__m512i decode_fp8_line_vbmi(__m256i raw) {
  const __m512i index = _mm512_permutexvar_epi8(code_pairs(), _mm512_castsi256_si512(raw));
  // Index bits 0-6 (the magnitude) select among 128 bytes; bit 7 (the sign) is ignored.
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(kLowBytes.data()), index,
                                               _mm512_load_si512(kLowBytes.data() + 64));
  const __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(kHighBytes.data()), index,
                                                _mm512_load_si512(kHighBytes.data() + 64));
  const __m512i magnitude = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, low, high);
  return _mm512_ternarylogic_epi32(magnitude, index, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // | sign
}

}  // namespace

void gemm_fp8_vdpbf16ps_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_fp8<DpBf16Fp8<decode_fp8_line<decode_fp8_line_vbmi>>, 4, 2, kDpRows, kDpGroups>(
      [&](int i) { return x.row(i); }, x.rows, w, y, y_stride);
}

void gemm_fp8_fma_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_fp8_on_widened_rows<decode_fp8_line_vbmi>(x, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
