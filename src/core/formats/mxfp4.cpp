// MXFP4 (OCP Microscaling): E2M1 codes, one E8M0 scale per 32 inputs; packed layout in kernels.h.
#include <cstring>

#include "formats.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(k / kMxfp4Block) * 4 * kMxfp4ChunkBytes; }
size_t group_scale_bytes(int k, int) { return size_t(k / kMxfp4Block) * kGroupRows; }

// Four canonical bytes (codes of inputs 2j, 2j + 1, ... 2j + 7, low nibble first) as one packed row
// word: the four low nibbles in bits 0-15, the four high ones in bits 16-31, byte j % 4 at 4 * (j % 4).
inline uint32_t row_word(uint32_t bytes) {
  const auto squeeze = [](uint32_t nibbles) {  // one nibble per byte -> four nibbles in 16 bits
    const uint32_t pairs = nibbles | (nibbles >> 4);
    return (pairs & 0xFF) | ((pairs >> 8) & 0xFF00);
  };
  return squeeze(bytes & 0x0F0F0F0F) | squeeze((bytes >> 4) & 0x0F0F0F0F) << 16;
}

void pack(const uint8_t* codes, const uint8_t* scales, int rows, int k, int, uint8_t* packed,
          uint8_t* packed_scales) {
  const int blocks = k / kMxfp4Block, row_bytes = k / 2;
  static_assert(kMxfp4Block % 8 == 0, "a row holds whole words");
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    uint8_t* group_scales = packed_scales + g * group_scale_bytes(k, kMxfp4Block);
    if (rows - g * kGroupRows < kGroupRows) {  // padding rows are zero
      std::memset(group, 0, group_bytes(k));
      std::memset(group_scales, 0, group_scale_bytes(k, kMxfp4Block));
    }
    for (int r = 0; r < kGroupRows && g * kGroupRows + r < rows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int j = 0; j < row_bytes; j += 4) {  // bytes j..j+3 = codes of inputs 2j..2j+7
        uint32_t bytes;
        std::memcpy(&bytes, codes + row * row_bytes + j, sizeof(bytes));
        const uint32_t word = row_word(bytes);
        std::memcpy(group + (j / 4) * kMxfp4ChunkBytes + 4 * r, &word, sizeof(word));
      }
      for (int b = 0; b < blocks; ++b) group_scales[b * kGroupRows + r] = scales[row * blocks + b];
    }
  }
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    const uint8_t* group_scales = w.scales + size_t(row / kGroupRows) * w.group_scale_bytes;
    uint8_t* dst = region.values + i * region.values_stride;
    for (int j = 0; j < region.cols / 2; ++j) {  // canonical byte = codes of inputs 2j (low), 2j + 1
      const int byte = region.k0 / 2 + j, shift = 4 * (byte % 4);
      uint32_t word;
      std::memcpy(&word, group + (byte / 4) * kMxfp4ChunkBytes + 4 * r, sizeof(word));
      dst[j] = uint8_t(((word >> shift) & 0xF) | ((word >> (16 + shift)) & 0xF) << 4);
    }
    uint8_t* scales = region.scales + i * region.scales_stride;
    for (int b = 0; b < region.cols / kMxfp4Block; ++b)
      scales[b] = group_scales[(region.k0 / kMxfp4Block + b) * kGroupRows + r];
  }
}

}  // namespace

extern const FormatTraits kMxfp4Format = {
    .name = "MXFP4",
    .value_bits = 4,
    .scale_type = ScaleType::kE8M0,
    .scale_groups = {kMxfp4Block, kEndOfList},
    .k_multiple = kMxfp4Block,
    .max_k = kMaxDimension,
    .activations = ActivationKind::kQuantizedOctetOrder,
    .group_bytes = group_bytes,
    .group_scale_bytes = group_scale_bytes,
    .pack = pack,
    .unpack = unpack,
    .gemm = &Kernels::mxfp4,
    .path = &KernelInfo::mxfp4_path,
};

KT_NAMESPACE_END
