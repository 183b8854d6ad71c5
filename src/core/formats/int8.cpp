// INT8: int8 weights, one float scale per row, stored as q + 128 (packed layout in kernels.h).
#include <cstring>

#include "formats.h"
#include "packed_positions.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(round_up(k, 4)) * kGroupRows; }
size_t group_scale_bytes(int, int) { return kGroupRows * sizeof(float); }

void pack(const uint8_t* values, const uint8_t* scale_bytes, int rows, int k, int, uint8_t* packed,
          uint8_t* packed_scales) {
  const int8_t* q = reinterpret_cast<const int8_t*>(values);
  const float* scales = reinterpret_cast<const float*>(scale_bytes);
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    float* group_scales = reinterpret_cast<float*>(packed_scales + g * group_scale_bytes(k, 0));
    std::memset(group, kInt8Offset, group_bytes(k));  // padding = weight 0
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      group_scales[r] = row < size_t(rows) ? scales[row] : 0.0f;
      if (row >= size_t(rows)) continue;
      pack_int8_row(q + row * k, k, r, group);
    }
  }
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    const uint8_t* group_scales = w.scales + size_t(row / kGroupRows) * w.group_scale_bytes;
    unpack_int8_row(group, r, region.k0, region.cols, region.values + i * region.values_stride);
    std::memcpy(region.scales + i * region.scales_stride, group_scales + r * sizeof(float), sizeof(float));
  }
}

}  // namespace

extern const FormatTraits kInt8Format = {
    .name = "INT8",
    .value_bits = 8,
    .scale_type = ScaleType::kFloat32,
    .scale_groups = {0, kEndOfList},
    .k_multiple = 1,
    .max_k = kInt8MaxK,
    .activations = ActivationKind::kQuantized,
    .group_bytes = group_bytes,
    .group_scale_bytes = group_scale_bytes,
    .pack = pack,
    .unpack = unpack,
    .gemm = &Kernels::int8,
    .path = &KernelInfo::int8_path,
};

KT_NAMESPACE_END
