// AVX2 MXFP4 GEMM (the universal fallback), in integers: twice an E2M1 value is an integer in
// -12..12, so one byte shuffle maps each code to the u8 2v + 12 and the 4-bit integer tiles
// (src/core/int_tiles.h, vpmaddubsw) multiply it with the int8 activations; each 32-input block's
// sum is scaled by its E8M0 power of two, halved (exact). The packed MXFP4 layout (kernels.h) is
// read as it is: a row's word holds inputs {0, 4, 1, 5} of each octet in its low nibbles and
// {2, 6, 3, 7} in its high nibbles, so the activations are put in that order once per call.
#include "int_dots.h"

KT_NAMESPACE_BEGIN
namespace {

constexpr int kRows = 2;  // 16 ymm registers: 2 rows x 2 halves of integer and float accumulators
// E2M1 code -> 2 x value + 12 (codes 8..15 are the negatives of 0..7).
alignas(16) constexpr int8_t kDoubledE2M1PlusOffset[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                           12, 11, 10, 9,  8,  6,  4,  0};
constexpr int kOctetOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // input of the octet at each activation slot

struct Mxfp4Format {
  static constexpr int kOffset = 12;
  static __m256i values(__m256i codes) {
    const __m256i table =
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kDoubledE2M1PlusOffset)));
    return _mm256_shuffle_epi8(table, codes);
  }
  static int inputs_per_scale(const PackedGroups&) { return kMxfp4Block; }
  // E8M0 s -> 2^(s - 127) / 2 for 8 rows (s = 0 is the fp32 denormal 2^-127).
  static __m256 scale(const uint8_t* group_scales, int block, int first_row) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group_scales + block * kGroupRows + first_row));
    const __m256i bits = _mm256_max_epi32(_mm256_slli_epi32(_mm256_cvtepu8_epi32(bytes), 23), _mm256_set1_epi32(kE8M0ZeroBits));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
  }
};

// The quantized rows of x with each octet in kOctetOrder, in a thread-local buffer that only grows.
const int8_t* octet_ordered_rows(const Activations& x, int k) {
  thread_local AlignedBuffer<int8_t> ordered;
  ordered.reserve(size_t(x.rows) * k);
  for (int i = 0; i < x.rows; ++i) {
    const int8_t* src = x.quantized_row(i).values;
    int8_t* dst = ordered.data() + size_t(i) * k;
    for (int c = 0; c < k; c += 8)
      for (int j = 0; j < 8; ++j) dst[c + j] = src[c + kOctetOrder[j]];
  }
  return ordered.data();
}

}  // namespace

bool mxfp4_int8_activations() { return true; }

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const int8_t* ordered = octet_ordered_rows(x, w.k);
  gemm_tiled<IntTiles<avx2::Vec, avx2::MaddubsDot, Mxfp4Format>::FourBitTile, kRows, 1, QuantizedRow>(
      [&](int i) {
        QuantizedRow row = x.quantized_row(i);  // octet order keeps each 32-input block's sum
        row.values = ordered + size_t(i) * w.k;
        return row;
      },
      x.rows, w, y, y_stride);
}

KT_NAMESPACE_END
