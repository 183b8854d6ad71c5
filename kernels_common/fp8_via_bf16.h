// FP8 E4M3 -> bf16 decoding (shared by every build), and the FP8 GEMM of the amx build: a few groups
// x one scale block of weights at a time are decoded to the BF16 layout on the stack (exact: every
// E4M3 value is a bf16) and multiplied by a BF16 GEMM (the tiles); each block's fp32 product is
// scaled and summed. Allocates nothing. The AVX2 / AVX512 register tiles are in fp8_tiles.h.
#pragma once

#include <algorithm>
#include <cstring>

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

// The decoders prefetch the codes this far ahead: a group's codes are one stream along K, read
// a block at a time between GEMMs, too slowly for the hardware prefetcher alone to keep DRAM busy.
constexpr int kFp8PrefetchBytes = 4096;

// Decode(codes, out, count): count bf16 from count codes, count a multiple of 32.
using Fp8DecodeFn = void (*)(const uint8_t* codes, bf16_t* out, size_t count);

template <GemmFn Bf16Gemm, Fp8DecodeFn Decode>
void gemm_fp8_via_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  // Stack buffers: decoded weights of kGroups groups x one block (16 KiB), and one block's product
  // for kRows rows (16 KiB).
  constexpr int kGroups = 4, kRows = 64, kCols = kGroups * kGroupRows;
  alignas(64) bf16_t decoded[kGroups * kGroupRows * kFp8Block];
  alignas(64) float product[kRows * kCols];
  const int block = w.scale_group > 0 ? w.scale_group : kFp8Block;
  const int k_even = round_up(w.k, 2);
  for (int g0 = 0; g0 < w.groups; g0 += kGroups) {
    const int groups = std::min(kGroups, w.groups - g0);
    for (int k0 = 0; k0 < k_even; k0 += block) {
      const int inputs = std::min(block, k_even - k0);  // even
      // The block's pairs of each group are contiguous: inputs / 2 pairs of 32 bytes.
      const size_t block_bytes = size_t(inputs) * kGroupRows;
      for (int g = 0; g < groups; ++g) {
        const uint8_t* codes = w.values + size_t(g0 + g) * w.group_bytes + size_t(k0) * kGroupRows;
        Decode(codes, decoded + size_t(g) * block_bytes, block_bytes);
      }
      const PackedGroups bf16{reinterpret_cast<const uint8_t*>(decoded), nullptr, block_bytes * sizeof(bf16_t), 0,
                              inputs, groups};
      const int scale_index = w.scale_group > 0 ? k0 / w.scale_group : 0;
      for (int i0 = 0; i0 < x.rows; i0 += kRows) {
        Activations rows = x;
        rows.rows = std::min(kRows, x.rows - i0);
        if (x.row_ids != nullptr)
          rows.row_ids += i0;
        else
          rows.base += size_t(i0) * x.stride;
        rows.base += k0;
        Bf16Gemm(rows, bf16, product, kCols);
        for (int g = 0; g < groups; ++g) {
          const float* scales = reinterpret_cast<const float*>(w.scales + size_t(g0 + g) * w.group_scale_bytes) +
                                scale_index * kGroupRows;
          for (int i = 0; i < rows.rows; ++i) {
            float* dst = y + size_t(i0 + i) * y_stride + (g0 + g) * kGroupRows;
            const float* src = product + i * kCols + g * kGroupRows;
            if (k0 == 0)
              for (int c = 0; c < kGroupRows; ++c) dst[c] = src[c] * scales[c];
            else
              for (int c = 0; c < kGroupRows; ++c) dst[c] += src[c] * scales[c];
          }
        }
      }
    }
  }
}

KT_NAMESPACE_END
