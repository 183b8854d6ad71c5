// MXFP4 (OCP Microscaling): E2M1 codes, one E8M0 scale per 32 inputs; packed layout in kernels.h.
#include <cstring>

#include "formats.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(k / kMxfp4Block) * 4 * kMxfp4ChunkBytes; }
size_t group_scale_bytes(int k, int) { return size_t(k / kMxfp4Block) * kGroupRows; }

void pack(const uint8_t* codes, const uint8_t* scales, int rows, int k, int, uint8_t* packed,
          uint8_t* packed_scales) {
  const int blocks = k / kMxfp4Block, row_bytes = k / 2;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    uint8_t* group_scales = packed_scales + g * group_scale_bytes(k, kMxfp4Block);
    std::memset(group, 0, group_bytes(k));
    std::memset(group_scales, 0, group_scale_bytes(k, kMxfp4Block));
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
