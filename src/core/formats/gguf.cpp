// GGUF: llama.cpp's integer block types as int8 values with an fp32 scale and min per 16 or 32
// inputs (w = q * scale + min); values stored as q + 128 in the INT8 layout, or, where they are 16
// levels, as 4-bit indices into them in the INT4 layout (kernels.h).
#include <cstring>

#include "formats.h"
#include "packed_positions.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(k) * kGroupRows; }
size_t group_scale_bytes(int k, int scale_group) { return size_t(k / scale_group) * kGgufPairFloats * sizeof(float); }

// The packed min of a canonical one: the kernels multiply it by -128 * sum(x) (kernels.h). Exact:
// a power of two.
constexpr float kMinFactor = -1.0f / kInt8Offset;

// The levels of the 4-bit and smaller ggml types (kt_kernel/gguf_blocks.py): Q4_1, Q4_K and Q2_K's
// 0..15; Q4_0 and Q3_K's -8..7; MXFP4's and NVFP4's E2M1 values doubled; IQ4_NL's and IQ4_XS's.
constexpr int8_t kLevelSets[][kLevels] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
};

bool levels_of(const int8_t* values, size_t count, int8_t* levels) {
  bool seen[256] = {};
  for (size_t i = 0; i < count; ++i) seen[uint8_t(values[i] + 128)] = true;
  for (const auto& set : kLevelSets) {
    bool held[256] = {};
    for (int8_t level : set) held[uint8_t(level + 128)] = true;
    bool all = true;
    for (int v = 0; v < 256 && all; ++v) all = !seen[v] || held[v];
    if (!all) continue;
    for (int i = 0; i < kLevels; ++i) levels[i] = int8_t(set[i] + 128);  // as u8: level + 128
    return true;
  }
  return false;
}

// One 16-row group's scales and mins (kernels.h), from canonical pairs [rows][k / G][scale, min].
void pack_pairs(const float* pairs, int rows, int k, int scale_group, int g, float* group_scales) {
  const int groups_per_row = k / scale_group;
  for (int r = 0; r < kGroupRows; ++r) {
    const size_t row = size_t(g) * kGroupRows + r;
    for (int s = 0; s < groups_per_row; ++s) {
      const float* pair = pairs + (row * groups_per_row + s) * 2;
      group_scales[s * kGgufPairFloats + r] = row < size_t(rows) ? pair[0] : 0.0f;
      group_scales[s * kGgufPairFloats + kGroupRows + r] = row < size_t(rows) ? pair[1] * kMinFactor : 0.0f;
    }
  }
}

void pack(const uint8_t* values, const uint8_t* scale_bytes, int rows, int k, int scale_group, uint8_t* packed,
          uint8_t* packed_scales) {
  const int8_t* q = reinterpret_cast<const int8_t*>(values);
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    pack_pairs(reinterpret_cast<const float*>(scale_bytes), rows, k, scale_group, g,
               reinterpret_cast<float*>(packed_scales + g * group_scale_bytes(k, scale_group)));
    std::memset(group, kInt8Offset, group_bytes(k));  // padding = weight 0
    for (int r = 0; r < kGroupRows && size_t(g) * kGroupRows + r < size_t(rows); ++r)
      pack_int8_row(q + (size_t(g) * kGroupRows + r) * k, k, r, group);
  }
}

void pack_indexed(const uint8_t* values, const uint8_t* scale_bytes, int rows, int k, int scale_group,
                  const int8_t* levels, uint8_t* packed, uint8_t* packed_scales) {
  const int8_t* q = reinterpret_cast<const int8_t*>(values);
  uint8_t index_of[256] = {};  // level + 128 -> its first index
  for (int i = kLevels - 1; i >= 0; --i) index_of[uint8_t(levels[i])] = uint8_t(i);
  const uint8_t zero = index_of[kInt8Offset];  // (padding rows have scale and min 0: any index is weight 0)
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * indexed_group_bytes(k);
    pack_pairs(reinterpret_cast<const float*>(scale_bytes), rows, k, scale_group, g,
               reinterpret_cast<float*>(packed_scales + g * group_scale_bytes(k, scale_group)));
    std::memset(group, zero | zero << 4, indexed_group_bytes(k));
    for (int r = 0; r < kGroupRows && size_t(g) * kGroupRows + r < size_t(rows); ++r) {
      const int8_t* row = q + (size_t(g) * kGroupRows + r) * k;
      for (int c = 0; c < k; ++c) {
        uint8_t& byte = group[nibble_position(c, r)];
        const int shift = nibble_shift(c);
        byte = uint8_t((byte & ~(0xF << shift)) | index_of[uint8_t(row[c] + 128)] << shift);
      }
    }
  }
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    const float* group_scales = reinterpret_cast<const float*>(w.scales + size_t(row / kGroupRows) * w.group_scale_bytes);
    uint8_t* dst = region.values + i * region.values_stride;
    if (w.levels == nullptr)
      unpack_int8_row(group, r, region.k0, region.cols, dst);
    else
      for (int c = 0; c < region.cols; ++c) {
        const int index = (group[nibble_position(region.k0 + c, r)] >> nibble_shift(region.k0 + c)) & 0xF;
        dst[c] = uint8_t(w.levels[index] - kInt8Offset);
      }
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
    .levels_of = levels_of,
    .pack_indexed = pack_indexed,
};

KT_NAMESPACE_END
