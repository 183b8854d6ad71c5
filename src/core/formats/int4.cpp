// INT4: signed 4-bit weights (two's complement, canonical), one float scale per 32, 64 or 128
// inputs; stored as q + 8 (packed layout in kernels.h).
#include <cstring>

#include "formats.h"
#include "packed_positions.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(k / 2) * kGroupRows; }
size_t group_scale_bytes(int k, int scale_group) { return size_t(k / scale_group) * kGroupRows * sizeof(float); }

void pack(const uint8_t* q, const uint8_t* scale_bytes, int rows, int k, int scale_group, uint8_t* packed,
          uint8_t* packed_scales) {
  const float* scales = reinterpret_cast<const float*>(scale_bytes);
  const int scales_per_row = k / scale_group;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* lines = packed + g * group_bytes(k);
    float* group_scales = reinterpret_cast<float*>(packed_scales + g * group_scale_bytes(k, scale_group));
    std::memset(lines, kInt4Offset | kInt4Offset << 4, group_bytes(k));  // padding = weight 0
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int s = 0; s < scales_per_row; ++s)
        group_scales[s * kGroupRows + r] = row < size_t(rows) ? scales[row * scales_per_row + s] : 0.0f;
      if (row >= size_t(rows)) continue;
      for (int c = 0; c < k; ++c) {
        const int nibble = (q[row * (k / 2) + c / 2] >> (4 * (c % 2))) & 0xF;
        const int offset_value = (nibble ^ 8);  // two's complement -8..7 -> 0..15 = q + 8
        uint8_t& byte = lines[nibble_position(c, r)];
        const int shift = nibble_shift(c);
        byte = uint8_t((byte & ~(0xF << shift)) | offset_value << shift);
      }
    }
  }
}

// Canonical offsets z' (weights (q - z') * s) -> the zero points of the stored q + 8, as int32.
void pack_zeros(const int8_t* zeros, int rows, int k, int scale_group, uint8_t* packed_zeros) {
  const int per_row = k / scale_group;
  for (int g = 0; g < packed_groups(rows); ++g) {
    int32_t* group = reinterpret_cast<int32_t*>(packed_zeros + g * group_scale_bytes(k, scale_group));
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int s = 0; s < per_row; ++s)
        group[s * kGroupRows + r] = kInt4Offset + (row < size_t(rows) ? zeros[row * per_row + s] : 0);
    }
  }
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    const uint8_t* group_scales = w.scales + size_t(row / kGroupRows) * w.group_scale_bytes;
    auto nibble = [&](int k) {  // two's complement, as canonical bytes hold it; stored as q + 8
      return ((group[nibble_position(k, r)] >> nibble_shift(k)) & 0xF) ^ kInt4Offset;
    };
    uint8_t* dst = region.values + i * region.values_stride;
    for (int j = 0; j < region.cols / 2; ++j) {
      const int k = region.k0 + 2 * j;
      dst[j] = uint8_t(nibble(k) | nibble(k + 1) << 4);
    }
    uint8_t* scales = region.scales + i * region.scales_stride;
    for (int s = 0; s < region.cols / w.scale_group; ++s)
      std::memcpy(scales + s * sizeof(float),
                  group_scales + (size_t(region.k0 / w.scale_group + s) * kGroupRows + r) * sizeof(float),
                  sizeof(float));
  }
}

}  // namespace

extern const FormatTraits kInt4Format = {
    .name = "INT4",
    .value_bits = 4,
    .scale_type = ScaleType::kFloat32,
    .scale_groups = {32, 64, 128, kEndOfList},
    .k_multiple = 32,
    .max_k = kMaxDimension,
    .activations = ActivationKind::kQuantized,
    .group_bytes = group_bytes,
    .group_scale_bytes = group_scale_bytes,
    .pack = pack,
    .unpack = unpack,
    .gemm = &Kernels::int4,
    .path = &KernelInfo::int8_path,
    .pack_zeros = pack_zeros,
};

KT_NAMESPACE_END
