// Scalar bfloat16 <-> float conversions (the compiler vectorizes loops over them).
#pragma once

#include <cstring>

#include "common.h"

KT_NAMESPACE_BEGIN

inline float bf16_to_float(bf16_t value) {
  uint32_t bits = uint32_t(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline bf16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return bf16_t(is_nan ? ((bits >> 16) | 0x40u) : rounded);
}

KT_NAMESPACE_END
