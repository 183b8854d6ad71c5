// FP8: E4M3 codes with float scales per channel or per block of inputs (the scale groups of its entry
// below; packed layout in kernels.h).
#include <algorithm>
#include <cstring>

#include "formats.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(round_up(k, 2)) * kGroupRows; }
size_t group_scale_bytes(int k, int scale_group) {
  return fp8_scale_bytes(k, scale_group) + fp8_small_code_words(k) * sizeof(uint64_t);
}

// Whether any byte of the word is zero (exact: the borrow can only start at a zero byte).
inline bool has_zero_byte(uint64_t x) { return ((x - 0x0101010101010101ull) & ~x & 0x8080808080808080ull) != 0; }

void pack(const uint8_t* codes, const uint8_t* scale_bytes, int rows, int k, int scale_group, uint8_t* packed,
          uint8_t* packed_scales) {
  const float* scales = reinterpret_cast<const float*>(scale_bytes);
  const int per_row = scale_groups_per_row(k, scale_group);
  const int pairs = ceil_div(k, 2), whole_pairs = k / 2;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    float* group_scales = reinterpret_cast<float*>(packed_scales + g * group_scale_bytes(k, scale_group));
    const int real_rows = std::min(kGroupRows, rows - g * kGroupRows);
    if (real_rows < kGroupRows || k % 2) std::memset(group, 0, group_bytes(k));  // code 0 = +0
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int s = 0; s < per_row; ++s)
        group_scales[s * kGroupRows + r] = r < real_rows ? scales[row * per_row + s] : 0.0f;
      if (r >= real_rows) continue;
      // Pair p of the row (two codes) goes to slot r of the group's pair p.
      const uint8_t* src = codes + row * k;
      for (int p = 0; p < whole_pairs; ++p) std::memcpy(group + size_t(p) * 2 * kGroupRows + 2 * r, src + 2 * p, 2);
      if (k % 2) group[size_t(whole_pairs) * 2 * kGroupRows + 2 * r] = src[k - 1];
    }
    // A pair's bit: some code of its 32 bytes has a zero exponent field (the kernels' slower decode).
    uint64_t* small_codes = reinterpret_cast<uint64_t*>(group_scales + per_row * kGroupRows);
    std::memset(small_codes, 0, fp8_small_code_words(k) * sizeof(uint64_t));
    static_assert(2 * kGroupRows == 4 * sizeof(uint64_t));
    for (int p = 0; p < pairs; ++p) {
      uint64_t words[4];
      std::memcpy(words, group + size_t(p) * 2 * kGroupRows, sizeof(words));
      bool small = false;
      for (uint64_t word : words) small |= has_zero_byte(word & 0x7878787878787878ull);
      if (small) small_codes[p / 64] |= uint64_t(1) << (p % 64);
    }
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
