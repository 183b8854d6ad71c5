// Packing into the layouts described in kernels.h (shared by every build).
#include <cstring>

#include "kernels.h"

KT_NAMESPACE_BEGIN

void pack_bf16(const bf16_t* weights, int rows, int k, uint8_t* packed) {
  const int k_pairs = round_up(k, 2) / 2;
  const size_t group_bytes = bf16_group_bytes(k);
  for (int g = 0; g < packed_groups(rows); ++g) {
    bf16_t* group = reinterpret_cast<bf16_t*>(packed + g * group_bytes);
    std::memset(group, 0, group_bytes);
    for (int r = 0; r < kGroupRows && g * kGroupRows + r < rows; ++r) {
      const bf16_t* row = weights + size_t(g * kGroupRows + r) * k;
      for (int p = 0; p < k_pairs; ++p) {
        group[(size_t(p) * kGroupRows + r) * 2] = row[2 * p];
        if (2 * p + 1 < k) group[(size_t(p) * kGroupRows + r) * 2 + 1] = row[2 * p + 1];
      }
    }
  }
}

void pack_mxfp4(const uint8_t* codes, const uint8_t* scales, int rows, int k, uint8_t* packed,
                uint8_t* packed_scales) {
  const int blocks = k / kMxfp4Block, row_bytes = k / 2;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * mxfp4_group_bytes(k);
    uint8_t* group_scales = packed_scales + g * mxfp4_group_scale_bytes(k);
    std::memset(group, 0, mxfp4_group_bytes(k));
    std::memset(group_scales, 0, mxfp4_group_scale_bytes(k));
    for (int r = 0; r < kGroupRows && g * kGroupRows + r < rows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int j = 0; j < row_bytes; ++j) {  // byte j = codes of inputs 2j (low) and 2j + 1 (high)
        const uint32_t byte = codes[row * row_bytes + j], shift = 4 * (j % 4);
        uint32_t word;
        uint8_t* at = group + (j / 4) * kMxfp4ChunkBytes + 4 * r;
        std::memcpy(&word, at, sizeof(word));
        word |= ((byte & 0xF) << shift) | ((byte >> 4) << (16 + shift));
        std::memcpy(at, &word, sizeof(word));
      }
      for (int b = 0; b < blocks; ++b) group_scales[b * kGroupRows + r] = scales[row * blocks + b];
    }
  }
}

KT_NAMESPACE_END
