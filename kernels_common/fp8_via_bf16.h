// FP8 E4M3 -> bf16 decoding, shared by every build: the AVX2 / AVX512 register tiles (fp8_tiles.h)
// and the amx build's AMX-BF16 tiles (kernels_amx/tile_gemm.cpp) multiply the decoded weights.
#pragma once

#include "kernels.h"

KT_NAMESPACE_BEGIN

// E4M3 -> bf16, exact, in 16-bit integer lanes: a normal code (exponent e > 0, mantissa m) is
// bf16 exponent e + 120 and mantissa m << 4, i.e. (code & 0x7F) << 4 plus 120 << 7; a subnormal one
// (m * 2^-9) is looked up here; the sign moves from bit 7 to bit 15. NaN codes (0x7F, 0xFF) are
// refused when the weights are loaded. Each build's vec.h implements it with its instructions.
constexpr uint16_t kFp8NormalBias = 120 << 7;
alignas(64) constexpr uint16_t kFp8SubnormalBf16[8] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

// The bf16 bits of the E4M3 magnitude m (code & 0x7F; 0x7F itself is NaN): for lookup tables.
constexpr uint16_t fp8_magnitude_bf16(int m) {
  return m < 8 ? kFp8SubnormalBf16[m] : uint16_t((m << 4) + kFp8NormalBias);
}

KT_NAMESPACE_END
