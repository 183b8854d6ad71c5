// FP8: E4M3 codes with float scales per channel or per block of inputs (the scale groups of its entry
// below; packed layout in kernels.h).
#include <cstring>

#include "formats.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(round_up(k, 2)) * kGroupRows; }
size_t group_scale_bytes(int k, int scale_group) {
  return fp8_scale_bytes(k, scale_group) + fp8_small_code_words(k) * sizeof(uint64_t);
}

void pack(const uint8_t* codes, const uint8_t* scale_bytes, int rows, int k, int scale_group, uint8_t* packed,
          uint8_t* packed_scales) {
  const float* scales = reinterpret_cast<const float*>(scale_bytes);
  const int per_row = scale_groups_per_row(k, scale_group);
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    float* group_scales = reinterpret_cast<float*>(packed_scales + g * group_scale_bytes(k, scale_group));
    std::memset(group, 0, group_bytes(k));  // code 0 = +0
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int s = 0; s < per_row; ++s)
        group_scales[s * kGroupRows + r] = row < size_t(rows) ? scales[row * per_row + s] : 0.0f;
      if (row >= size_t(rows)) continue;
      for (int c = 0; c < k; ++c) group[(c / 2) * 2 * kGroupRows + 2 * r + c % 2] = codes[row * k + c];
    }
    uint64_t* small_codes = reinterpret_cast<uint64_t*>(group_scales + per_row * kGroupRows);
    std::memset(small_codes, 0, fp8_small_code_words(k) * sizeof(uint64_t));
    for (int p = 0; p < ceil_div(k, 2); ++p)
      for (int b = 0; b < 2 * kGroupRows; ++b)
        if ((group[p * 2 * kGroupRows + b] & 0x78) == 0) small_codes[p / 64] |= uint64_t(1) << (p % 64);
  }
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  const int per_row = scale_groups_per_row(w.k, w.scale_group);
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    const float* group_scales = reinterpret_cast<const float*>(w.scales + size_t(row / kGroupRows) * w.group_scale_bytes);
    uint8_t* dst = region.values + i * region.values_stride;
    for (int c = 0; c < region.cols; ++c) {
      const int k = region.k0 + c;
      dst[c] = group[(k / 2) * 2 * kGroupRows + 2 * r + k % 2];
    }
    const int first = w.scale_group > 0 ? region.k0 / w.scale_group : 0;
    const int count = scale_groups_per_row(region.cols, w.scale_group);
    for (int s = 0; s < count && first + s < per_row; ++s)
      std::memcpy(region.scales + i * region.scales_stride + s * sizeof(float), group_scales + (first + s) * kGroupRows + r,
                  sizeof(float));
  }
}

}  // namespace

extern const FormatTraits kFp8Format = {
    .name = "FP8",
    .value_bits = 8,
    .scale_type = ScaleType::kFloat32,
    .scale_groups = {0, kNvfp4Block, kMxfp8Block, kFp8Block},
    .k_multiple = 1,
    .max_k = kMaxDimension,
    .activations = ActivationKind::kBf16,
    .group_bytes = group_bytes,
    .group_scale_bytes = group_scale_bytes,
    .pack = pack,
    .unpack = unpack,
    .gemm = &Kernels::fp8,
    .path = &KernelInfo::fp8_path,
};

KT_NAMESPACE_END
