// FP8 on CPUs with AVX512_VBMI: 64 codes (two input pairs of a group) decoded at once. Lines with a
// zero or subnormal code are decoded exactly by a byte permute, two 128-entry byte lookups
// (vpermi2b: the low and the high byte of each magnitude's bf16), the sign bit and two byte
// interleaves, three instructions per 32 codes where vec.h's exact decoder takes nine. This file
// alone is compiled with -mavx512vbmi and -mavx512bf16 (CMakeLists.txt); paths.cpp calls its
// vdpbf16ps GEMM only after CPUID reported both, its FMA GEMM after it reported AVX512_VBMI.
#include <array>

#include "vec.h"

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

// The byte interleaves pair bytes 0-7 (unpacklo) and 8-15 (unpackhi) of each 128-bit lane: this
// order of the 64 codes makes unpacklo give codes 0-31 and unpackhi codes 32-63, each in order.
alignas(64) constexpr std::array<uint8_t, 64> kInterleaveOrder = [] {
  std::array<uint8_t, 64> order{};
  for (int lane = 0; lane < 4; ++lane)
    for (int t = 0; t < 8; ++t) {
      order[16 * lane + t] = uint8_t(8 * lane + t);
      order[16 * lane + 8 + t] = uint8_t(32 + 8 * lane + t);
    }
  return order;
}();

// Two lines, exactly, by the lookups.
[[gnu::noinline]] void decode_fp8_pairs_by_lookup(__m512i codes, __m512i (&lines)[2]) {
  const __m512i ordered = _mm512_permutexvar_epi8(_mm512_load_si512(kInterleaveOrder.data()), codes);
  // Index bits 0-6 (the magnitude) select among 128 bytes; bit 7 (the sign) is ignored.
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(kLowBytes.data()), ordered,
                                               _mm512_load_si512(kLowBytes.data() + 64));
  const __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(kHighBytes.data()), ordered,
                                                _mm512_load_si512(kHighBytes.data() + 64));
  const __m512i signed_high = _mm512_ternarylogic_epi32(high, ordered, _mm512_set1_epi8(int8_t(0x80)), 0xF8);  // | sign
  lines[0] = _mm512_unpacklo_epi8(low, signed_high);
  lines[1] = _mm512_unpackhi_epi8(low, signed_high);
}

// Two lines of normal codes by vec.h's shortcut, which takes as many instructions as the lookups
// but fewer of the shuffles they are made of (Zen 4 runs shuffles slower); any other pair of lines
// by the lookups. One check for both lines.
void decode_fp8_pairs(const uint8_t* codes, __m512i (&lines)[2]) {
  const __m512i raw = _mm512_loadu_si512(codes);
  if (__builtin_expect(_mm512_testn_epi8_mask(raw, _mm512_set1_epi8(0x78)) != 0, 0))
    return decode_fp8_pairs_by_lookup(raw, lines);
  lines[0] = decode_fp8_normal(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  lines[1] = decode_fp8_normal(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32)));
}

// Path P (vec.h) with its lines decoded two at a time (a block's odd last pair by P's decoder).
template <class P>
struct PairDecoding : P {
  static void decode_two(const uint8_t* codes, typename P::Bits (&lines)[2]) { decode_fp8_pairs(codes, lines); }
};

}  // namespace

void gemm_fp8_vdpbf16ps_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_fp8<PairDecoding<DpBf16Fp8<decode_fp8_line>>, 4, 2, kDpRows, kDpGroups>([&](int i) { return x.row(i); }, x.rows,
                                                                                w, y, y_stride);
}

void gemm_fp8_fma_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_fp8_on_widened_rows<PairDecoding<FmaFp8<decode_fp8_line>>>(x, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
