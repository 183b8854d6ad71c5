// GGUF: llama.cpp's integer block types as int8 values with an fp32 scale and min per 16 or 32
// inputs (w = q * scale + min); values stored as q + 128 in the INT8 layout (kernels.h).
#include <cstring>

#include "formats.h"
#include "int8_rows.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(k) * kGroupRows; }
size_t group_scale_bytes(int k, int scale_group) { return size_t(k / scale_group) * kGgufPairFloats * sizeof(float); }

// The packed min of a canonical one: the kernels multiply it by -128 * sum(x) (kernels.h). Exact:
// a power of two.
constexpr float kMinFactor = -1.0f / kInt8Offset;

void pack(const uint8_t* values, const uint8_t* scale_bytes, int rows, int k, int scale_group, uint8_t* packed,
          uint8_t* packed_scales) {
  const int8_t* q = reinterpret_cast<const int8_t*>(values);
  const float* pairs = reinterpret_cast<const float*>(scale_bytes);  // [rows][k / G][scale, min]
  const int groups_per_row = k / scale_group;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    float* group_scales = reinterpret_cast<float*>(packed_scales + g * group_scale_bytes(k, scale_group));
    std::memset(group, kInt8Offset, group_bytes(k));  // padding = weight 0
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int s = 0; s < groups_per_row; ++s) {
        const float* pair = pairs + (row * groups_per_row + s) * 2;
        group_scales[s * kGgufPairFloats + r] = row < size_t(rows) ? pair[0] : 0.0f;
        group_scales[s * kGgufPairFloats + kGroupRows + r] = row < size_t(rows) ? pair[1] * kMinFactor : 0.0f;
      }
      if (row >= size_t(rows)) continue;
      pack_int8_row(q + row * k, k, r, group);
    }
  }
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    const float* group_scales = reinterpret_cast<const float*>(w.scales + size_t(row / kGroupRows) * w.group_scale_bytes);
    unpack_int8_row(group, r, region.k0, region.cols, region.values + i * region.values_stride);
    for (int s = 0; s < region.cols / w.scale_group; ++s) {
      const float* packed = group_scales + size_t(region.k0 / w.scale_group + s) * kGgufPairFloats;
      const float pair[2] = {packed[r], packed[kGroupRows + r] / kMinFactor};
      std::memcpy(region.scales + i * region.scales_stride + s * sizeof(pair), pair, sizeof(pair));
    }
  }
}

}  // namespace

extern const FormatTraits kGgufFormat = {
    .name = "GGUF",
    .value_bits = 8,
    .scale_type = ScaleType::kFloat32,
    .scale_groups = {16, 32, kEndOfList},
    .k_multiple = 32,
    .max_k = kMaxDimension,
    .activations = ActivationKind::kQuantized,
    .group_bytes = group_bytes,
    .group_scale_bytes = group_scale_bytes,
    .pack = pack,
    .unpack = unpack,
    .gemm = &Kernels::gguf,
    .path = &KernelInfo::gguf_path,
    .scales_per_group = 2,
};

KT_NAMESPACE_END
