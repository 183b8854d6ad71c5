#include "byte_scan.h"

#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

KT_NAMESPACE_BEGIN

int64_t first_byte_match(const uint8_t* data, size_t size, uint8_t mask, uint8_t value) {
  // Blocks are tested whole (a loop without an early exit vectorizes), the hit found in its block.
  constexpr size_t kBlock = 4096;
  for (size_t start = 0; start < size; start += kBlock) {
    const size_t end = start + kBlock < size ? start + kBlock : size;
    uint8_t hit = 0;
    for (size_t i = start; i < end; ++i) hit |= uint8_t((data[i] & mask) == value);
    if (!hit) continue;
    for (size_t i = start; i < end; ++i)
      if ((data[i] & mask) == value) return int64_t(i);
  }
  return -1;
}

void map_bytes(const uint8_t* in, size_t size, const uint8_t* table, uint8_t* out) {
  for (size_t i = 0; i < size; ++i) out[i] = table[in[i]];
}

void expand_nibbles(const uint8_t* in, size_t size, const uint8_t* table, uint8_t* out) {
  size_t i = 0;
#if defined(__AVX2__)
  // 32 bytes at a time: both nibbles looked up by a byte shuffle, then interleaved (per 128-bit lane).
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (; i + 32 <= size; i += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i low = _mm256_shuffle_epi8(lut, _mm256_and_si256(bytes, low4));
    const __m256i high = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
    const __m256i first = _mm256_unpacklo_epi8(low, high);  // inputs 0..7 | 16..23
    const __m256i second = _mm256_unpackhi_epi8(low, high);  // inputs 8..15 | 24..31
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), _mm256_permute2x128_si256(first, second, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i + 32),
                        _mm256_permute2x128_si256(first, second, 0x31));
  }
#endif
  for (; i < size; ++i) {
    out[2 * i] = table[in[i] & 15];
    out[2 * i + 1] = table[in[i] >> 4];
  }
}

KT_NAMESPACE_END
