// What the AVX512 kernel files share (and the amx build, which runs them below its tile sizes):
// the vector traits of the shared tiles, bf16 helpers, and the build's GEMMs, which paths.cpp puts
// in the kernel table by what the CPU has.
#pragma once

// GCC 12 reports its own _mm512_undefined_*() as (maybe-)uninitialized: a header false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "fp8_tiles.h"

KT_NAMESPACE_BEGIN
namespace avx512 {

// The kernel table of this CPU: the AVX512_BF16 / AVX512_VNNI paths where CPUID reports them and
// KT_KERNEL_DISABLE_AVX512_BF16=1 / KT_KERNEL_DISABLE_AVX512_VNNI=1 do not forbid them (the tests
// cover both kinds of path on one machine). Chosen on the first call (init_kernels).
const Kernels& paths();
KernelInfo paths_info();
// fp32 FMA, and vdpbf16ps / vpdpbusd where CPUID reports them (peak_probe.cpp); 0 for AMX tiles.
double peak_probe(PeakOp op, int64_t iterations);

// Plain AVX512F / AVX512BW: gemm_bf16.cpp, gemm_int.cpp and gemm_fp8.cpp.
void gemm_bf16_fma(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_int8_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_int4_maddubs(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_mxfp4_maddubs(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_gguf_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_fp8_fma(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);

// All AVX512_BF16 code, in vdpbf16ps.cpp (the one file compiled with -mavx512bf16), and all
// AVX512_VNNI code, in vpdpbusd.cpp (-mavx512vnni): called only after CPUID reported them.
void gemm_bf16_vdpbf16ps(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_fp8_vdpbf16ps(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
// FP8 decoded by byte lookups, in fp8_vbmi.cpp (-mavx512vbmi -mavx512bf16): called only after CPUID
// reported AVX512_VBMI (and AVX512_BF16 for the vdpbf16ps one).
void gemm_fp8_vdpbf16ps_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_fp8_fma_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
double dpbf16_peak_probe(int64_t iterations);  // flops done
void gemm_int8_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_int4_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_mxfp4_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_gguf_vpdpbusd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
// MXFP4 codes looked up by vpermb, in mxfp4_vbmi.cpp (-mavx512vnni -mavx512vbmi).
void gemm_mxfp4_vpdpbusd_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
double dpbusd_peak_probe(int64_t iterations);  // integer ops done


// The vector traits of the integer tiles (kernels_common/int_tiles.h): one zmm = one 16-row group.
struct Vec {
  using Int = __m512i;
  using Float = __m512;
  static constexpr int kLanes = 16;
  static Int load(const uint8_t* p) { return _mm512_load_si512(p); }
  static Float load_ps(const float* p) { return _mm512_load_ps(p); }
  static Float loadu_ps(const float* p) { return _mm512_loadu_ps(p); }
  static Int set1(int32_t v) { return _mm512_set1_epi32(v); }
  static Float set1_ps(float v) { return _mm512_set1_ps(v); }
  static Int and_(Int a, Int b) { return _mm512_and_si512(a, b); }
  static Int or_(Int a, Int b) { return _mm512_or_si512(a, b); }
  static Int add_epi8(Int a, Int b) { return _mm512_add_epi8(a, b); }
  static Int srli_epi32(Int a, int n) { return _mm512_srli_epi32(a, n); }
  static Int srli_epi16(Int a, int n) { return _mm512_srli_epi16(a, n); }
  static Int madd_epi16(Int a, Int b) { return _mm512_madd_epi16(a, b); }
  static Int maddubs_epi16(Int a, Int b) { return _mm512_maddubs_epi16(a, b); }
  static Int add_epi16(Int a, Int b) { return _mm512_add_epi16(a, b); }
  static Int slli_epi32(Int a, int n) { return _mm512_slli_epi32(a, n); }
  static Int add_epi32(Int a, Int b) { return _mm512_add_epi32(a, b); }
  static Int sub_epi32(Int a, Int b) { return _mm512_sub_epi32(a, b); }
  static Int mullo_epi32(Int a, Int b) { return _mm512_mullo_epi32(a, b); }
  static Float to_float(Int a) { return _mm512_cvtepi32_ps(a); }
  static Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float add_ps(Float a, Float b) { return _mm512_add_ps(a, b); }
  static void storeu_ps(float* p, Float a) { _mm512_storeu_ps(p, a); }
  static Int lookup16(const int8_t* table, Int indices) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table))), indices);
  }
  // kLanes int8 -> fp32.
  static Float int8_to_float(const int8_t* values) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values))));
  }
  // kLanes unsigned E4M3 codes -> fp32, exactly (as the AVX2 one).
  static Float e4m3_to_float(const uint8_t* codes) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bytes, 20)), _mm512_set1_ps(0x1p120f));
  }
  // kLanes fp16 (unaligned) -> fp32, exactly (F16C's AVX512 form).
  static Float half_to_float(const uint8_t* halfs) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halfs)));
  }
  // kLanes 6-bit fields (lane i at bits 6i..6i+5 of the 12 bytes; 16 read) minus bias -> fp32, as
  // the AVX2 one: the 16 bytes in every 128-bit lane, each lane's two bytes put in place by vpshufb.
  static Float six_bits_to_float(const uint8_t* bytes, int bias) {
    alignas(64) static constexpr int8_t kPairs[64] = {
        0, 1, -1, -1, 0, 1, -1, -1, 1, 2,  -1, -1, 2,  3,  -1, -1, 3,  4,  -1, -1, 3,  4,
        -1, -1, 4, 5, -1, -1, 5, 6, -1, -1, 6, 7,  -1, -1, 6,  7,  -1, -1, 7,  8,  -1, -1,
        8, 9, -1, -1, 9, 10, -1, -1, 9, 10, -1, -1, 10, 11, -1, -1, 11, 12, -1, -1};
    const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m512i pairs = _mm512_shuffle_epi8(raw, _mm512_load_si512(kPairs));
    const __m512i shifts = _mm512_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2);
    const __m512i fields = _mm512_and_si512(_mm512_srlv_epi32(pairs, shifts), _mm512_set1_epi32(63));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(fields, _mm512_set1_epi32(bias)));
  }
  // kLanes 4-bit fields (lane i at bits 4i..4i+3 of the 8 bytes) -> fp32: the low and high nibbles
  // interleaved into bytes, widened.
  static Float four_bits_to_float(const uint8_t* bytes) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)), mask = _mm_set1_epi8(15);
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
  }
  static Float e8m0_to_float(const uint8_t* scales) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    return _mm512_castsi512_ps(_mm512_max_epi32(_mm512_slli_epi32(bytes, 23), _mm512_set1_epi32(kE8M0ZeroBits)));
  }
};

// bf16 -> fp32 of the even (low half) and odd (high half) element of each 32-bit lane.
inline __m512 even_bf16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_bf16(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// FP8 codes -> bf16 (fp8_via_bf16.h): 32 codes, one packed pair of a group (kernels.h).
// Exact for every code: the subnormals looked up by vpermw.
inline __m512i decode_fp8_line_exact(__m256i raw) {
  const __m512i subnormals = _mm512_castsi128_si512(_mm_load_si128(reinterpret_cast<const __m128i*>(kFp8SubnormalBf16)));
  const __m512i v = _mm512_cvtepu8_epi16(raw);
  const __m512i magnitude = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(kFp8NormalBias));
  const __m512i subnormal = _mm512_permutexvar_epi16(magnitude, subnormals);  // index < 8 where used
  const __mmask32 is_subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
  return _mm512_or_si512(_mm512_mask_blend_epi16(is_subnormal, normal, subnormal), sign);
}

// 32 normal codes (exponent field > 0), as nearly all codes of real weights are: the sign-extended
// code shifted left by 4 holds the sign in bits 11-15 and the magnitude in bits 4-10, so masking
// bits 11-14 and adding the bias gives the bf16.
inline __m512i decode_fp8_normal(__m256i raw) {
  const __m512i shifted = _mm512_slli_epi16(_mm512_cvtepi8_epi16(raw), 4);
  return _mm512_add_epi16(_mm512_and_si512(shifted, _mm512_set1_epi16(int16_t(0x87FF))),
                          _mm512_set1_epi16(kFp8NormalBias));
}

// 32 codes: the normal shortcut, or Exact(raw) for a line with a zero or subnormal code. Marked
// unlikely, so that the compiler lays the shortcut out as the straight path (one core, codes in
// cache: 22 -> 32 Gweights/s).
template <__m512i (*Exact)(__m256i) = decode_fp8_line_exact>
inline __m512i decode_fp8_line(const uint8_t* codes) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  if (__builtin_expect(_mm256_testn_epi8_mask(raw, _mm256_set1_epi8(0x78)) != 0, 0)) return Exact(raw);
  return decode_fp8_normal(raw);
}

// FP8 on vdpbf16ps (fp8_tiles.h): decoded weight lines straight as its operands; Decode(codes)
// gives 32 codes as bf16. A template, so that only the files compiled with -mavx512bf16 (which call
// it after a CPUID check) instantiate it.
template <__m512i (*Decode)(const uint8_t*)>
struct DpBf16Fp8 : Vec {
  using Row = const bf16_t*;
  using Line = __m512bh;
  using Act = __m512bh;
  using Bits = __m512i;
  static Bits decode_bits(const uint8_t* codes) { return Decode(codes); }
  static Line line_of(Bits bits) { return (__m512bh)bits; }
  static constexpr int kCodeBytes = 1;
  static constexpr bool kScaled = true;
  using Stored = bf16_t;
  static void store_line(bf16_t* at, Bits bits, Line) { _mm512_store_si512(at, bits); }
  static Line load_line(const bf16_t* at) { return (__m512bh)_mm512_load_si512(at); }
  static Act act(Row x, int p) { return (__m512bh)_mm512_set1_epi32(load_bf16_pair(x + 2 * p)); }
  static Float dot(Float acc, Line w, Act a) { return _mm512_dpbf16_ps(acc, a, w); }
};
constexpr int kDpRows = 6, kDpGroups = 4;  // the vdpbf16ps tiles: 24 accumulators + 4 weight lines

// FP8 on fp32 FMA (fp8_tiles.h): decoded weight lines widened like the BF16 ones, on widened rows
// (widen_rows); Decode as above.
template <__m512i (*Decode)(const uint8_t*)>
struct FmaFp8 : Vec {
  using Row = const float*;
  struct Line {
    __m512 even, odd;
  };
  using Act = Line;
  using Bits = __m512i;
  static Bits decode_bits(const uint8_t* codes) { return Decode(codes); }
  static Line line_of(Bits pairs) { return {even_bf16(pairs), odd_bf16(pairs)}; }
  static constexpr int kCodeBytes = 1;
  static constexpr bool kScaled = true;
  // The stack keeps the lines widened: the later tiles of rows load them as they are.
  using Stored = float;
  static void store_line(float* at, Bits, const Line& line) {
    _mm512_store_ps(at, line.even);
    _mm512_store_ps(at + kLanes, line.odd);
  }
  static Line load_line(const float* at) { return {_mm512_load_ps(at), _mm512_load_ps(at + kLanes)}; }
  static Act act(Row x, int p) { return {_mm512_set1_ps(x[2 * p]), _mm512_set1_ps(x[2 * p + 1])}; }
  static Float dot(Float acc, const Line& w, const Act& a) {
    return _mm512_fmadd_ps(a.odd, w.odd, _mm512_fmadd_ps(a.even, w.even, acc));
  }
};

// The BF16 format on fp32 FMA through the stack driver of fp8_tiles.h (gemm_bf16.cpp): its lines are
// bf16 as stored, two bytes per weight, and it has no scales.
inline __m512i load_bf16_line(const uint8_t* line) { return _mm512_load_si512(line); }
struct FmaBf16 : FmaFp8<load_bf16_line> {
  static constexpr int kCodeBytes = 2;
  static constexpr bool kScaled = false;
};

// The fp32 FMA tiles (gemm_bf16.cpp): rows x 16-column groups of zmm accumulators.
constexpr int kFmaRows = 4, kFmaGroups = 4;  // 16 accumulators + 8 decoded weight vectors

}  // namespace avx512
KT_NAMESPACE_END
