// What the AVX2 kernel files share: the ymm vector traits of the shared integer tiles (a 16-row
// group is two ymm), bf16 helpers, and the build's GEMMs, which entry.cpp puts in the kernel table.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "fp8_tiles.h"
#include "int_tiles.h"

KT_NAMESPACE_BEGIN
namespace avx2 {

void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);   // gemm_bf16.cpp
void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);   // gemm_int.cpp
void gemm_int4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);   // gemm_int.cpp
void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);  // gemm_int.cpp
void gemm_gguf(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);   // gemm_int.cpp
void gemm_fp8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);    // gemm_fp8.cpp
// GGUF's Q4_K or Q6_K with exact activations, a token at a time through one-token tiles
// (gemm_one_token.cpp); false where x or w is not of that form, or x has more tokens than they serve
// faster than the shared tile.
bool gemm_gguf_one_token(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
double peak_probe(PeakOp op, int64_t iterations);                                         // peak_probe.cpp
// The integer formats on vpdpbusd (AVX-VNNI), in vpdpbusd_avx.cpp (-mavxvnni): called only after CPUID
// reported AVX-VNNI (entry.cpp).
void gemm_int8_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_int4_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_mxfp4_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_gguf_avx_vnni(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
double dpbusd_avx_peak_probe(int64_t iterations);  // integer ops done

// FP8 codes -> bf16 (fp8_via_bf16.h): 16 codes, half a packed pair of a group (kernels.h).
// Exact for every code: the subnormals by vpshufb on byte pairs. Out of line: inlined into the tiles,
// its constants no longer fit the 16 registers and the compiler rebuilt them for every line.
[[gnu::noinline, gnu::cold]] inline __m256i decode_fp8_line_exact(__m128i raw) {
  const __m256i subnormals =
      _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kFp8SubnormalBf16)));
  const __m256i v = _mm256_cvtepu8_epi16(raw);
  const __m256i magnitude = _mm256_and_si256(v, _mm256_set1_epi16(0x7F));
  const __m256i normal = _mm256_add_epi16(_mm256_slli_epi16(magnitude, 4), _mm256_set1_epi16(kFp8NormalBias));
  // Word m of the table is bytes 2m, 2m + 1: shuffle control (2m) | (2m + 1) << 8 per 16-bit lane.
  const __m256i control =
      _mm256_add_epi16(_mm256_mullo_epi16(magnitude, _mm256_set1_epi16(0x0202)), _mm256_set1_epi16(0x0100));
  const __m256i subnormal = _mm256_shuffle_epi8(subnormals, control);  // bytes < 16 where used
  const __m256i is_subnormal = _mm256_cmpgt_epi16(_mm256_set1_epi16(8), magnitude);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
  return _mm256_or_si256(_mm256_blendv_epi8(normal, subnormal, is_subnormal), sign);
}

// The same, faster when all 16 codes are normal (exponent field > 0), as nearly all codes of real
// weights are: the sign-extended code shifted left by 4 holds the sign in bits 11-15 and the
// magnitude in bits 4-10, so masking bits 11-14 and adding the bias gives the bf16. A line with a
// zero or subnormal code (exponent field 0) takes the exact decoder (marked unlikely, so that the
// shortcut is laid out as the straight path).
inline __m256i decode_fp8_line(const uint8_t* codes) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  // (code & 0x78) + 0x78 carries into bit 7 exactly when the exponent field is not 0.
  const __m128i exponent = _mm_and_si128(raw, _mm_set1_epi8(0x78));
  if (__builtin_expect(!_mm_testc_si128(_mm_add_epi8(exponent, _mm_set1_epi8(0x78)), _mm_set1_epi8(char(0x80))), 0))
    return decode_fp8_line_exact(raw);
  const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 4);
  return _mm256_add_epi16(_mm256_and_si256(shifted, _mm256_set1_epi16(int16_t(0x87FF))),
                          _mm256_set1_epi16(kFp8NormalBias));
}

// bf16 -> fp32 of the even (low half) and odd (high half) element of each 32-bit lane.
inline __m256 even_bf16(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

struct Vec {
  using Int = __m256i;
  using Float = __m256;
  static constexpr int kLanes = 8;
  static Int load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static Float load_ps(const float* p) { return _mm256_load_ps(p); }
  static Float loadu_ps(const float* p) { return _mm256_loadu_ps(p); }
  static Int set1(int32_t v) { return _mm256_set1_epi32(v); }
  static Float set1_ps(float v) { return _mm256_set1_ps(v); }
  static Int and_(Int a, Int b) { return _mm256_and_si256(a, b); }
  static Int or_(Int a, Int b) { return _mm256_or_si256(a, b); }
  static Int add_epi8(Int a, Int b) { return _mm256_add_epi8(a, b); }
  static Int srli_epi32(Int a, int n) { return _mm256_srli_epi32(a, n); }
  static Int srli_epi16(Int a, int n) { return _mm256_srli_epi16(a, n); }
  static Int madd_epi16(Int a, Int b) { return _mm256_madd_epi16(a, b); }
  static Int maddubs_epi16(Int a, Int b) { return _mm256_maddubs_epi16(a, b); }
  static Int add_epi16(Int a, Int b) { return _mm256_add_epi16(a, b); }
  static Int slli_epi32(Int a, int n) { return _mm256_slli_epi32(a, n); }
  static Int add_epi32(Int a, Int b) { return _mm256_add_epi32(a, b); }
  static Int sub_epi32(Int a, Int b) { return _mm256_sub_epi32(a, b); }
  static Int mullo_epi32(Int a, Int b) { return _mm256_mullo_epi32(a, b); }
  static Float to_float(Int a) { return _mm256_cvtepi32_ps(a); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float add_ps(Float a, Float b) { return _mm256_add_ps(a, b); }
  static void storeu_ps(float* p, Float a) { _mm256_storeu_ps(p, a); }
  static Int lookup16(const int8_t* table, Int indices) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table))),
                               indices);
  }
  // kLanes int8 -> fp32.
  static Float int8_to_float(const int8_t* values) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(values))));
  }
  // kLanes unsigned E4M3 codes -> fp32, exactly: the code's bits as an fp32's exponent and top mantissa
  // bits are its value times 2^-120 (the subnormal codes as fp32 denormals: no DAZ here).
  static Float e4m3_to_float(const uint8_t* codes) {
    const __m256i bits =
        _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))), 20);
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
  }
  // kLanes fp16 (unaligned) -> fp32, exactly (F16C).
  static Float half_to_float(const uint8_t* halfs) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halfs)));
  }
  // kLanes 6-bit fields (lane i at bits 6i..6i+5 of the 6 bytes; 8 read) minus bias -> fp32: each
  // lane's two bytes put in place by vpshufb, shifted by its bit offset, masked.
  static Float six_bits_to_float(const uint8_t* bytes, int bias) {
    const __m256i raw = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    const __m256i pairs = _mm256_shuffle_epi8(
        raw, _mm256_setr_epi8(0, 1, -1, -1, 0, 1, -1, -1, 1, 2, -1, -1, 2, 3, -1, -1,  //
                              3, 4, -1, -1, 3, 4, -1, -1, 4, 5, -1, -1, 5, 6, -1, -1));
    const __m256i fields =
        _mm256_and_si256(_mm256_srlv_epi32(pairs, _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2)), _mm256_set1_epi32(63));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(fields, _mm256_set1_epi32(bias)));
  }
  // kLanes 4-bit fields (lane i at bits 4i..4i+3 of the 4 bytes) -> fp32: the word in every lane,
  // each lane shifted by its own offset, masked.
  static Float four_bits_to_float(const uint8_t* bytes) {
    uint32_t word;
    std::memcpy(&word, bytes, sizeof(word));
    const __m256i offsets = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i shifted = _mm256_srlv_epi32(_mm256_set1_epi32(int(word)), offsets);
    return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(15)));
  }
  static Float e8m0_to_float(const uint8_t* scales) {
    const __m256i bits =
        _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales))), 23);
    return _mm256_castsi256_ps(_mm256_max_epi32(bits, _mm256_set1_epi32(kE8M0ZeroBits)));
  }
};

}  // namespace avx2
KT_NAMESPACE_END
