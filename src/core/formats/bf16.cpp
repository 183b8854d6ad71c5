// BF16: the weights themselves (kernels.h: pairs of inputs of the 16 rows side by side), no scales.
#include <algorithm>
#include <cstring>

#include "formats.h"

KT_NAMESPACE_BEGIN
namespace {

size_t group_bytes(int k) { return size_t(round_up(k, 2)) * kGroupRows * sizeof(bf16_t); }
size_t group_scale_bytes(int, int) { return 0; }

void pack(const uint8_t* values, const uint8_t*, int rows, int k, int, uint8_t* packed, uint8_t*) {
  const bf16_t* weights = reinterpret_cast<const bf16_t*>(values);
  const int whole_pairs = k / 2;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes(k);
    const int real_rows = std::min(kGroupRows, rows - g * kGroupRows);
    // Padding (rows past the end, an odd k's last input) is zero; whole groups need no clearing.
    if (real_rows < kGroupRows || k % 2) std::memset(group, 0, group_bytes(k));
    for (int r = 0; r < real_rows; ++r) {
      const bf16_t* row = weights + size_t(g * kGroupRows + r) * k;
      // Pair p of the row (two bf16, four bytes) goes to slot r of the group's pair p.
      for (int p = 0; p < whole_pairs; ++p)
        std::memcpy(group + (size_t(p) * kGroupRows + r) * 2 * sizeof(bf16_t), row + 2 * p, 2 * sizeof(bf16_t));
      if (k % 2)
        std::memcpy(group + (size_t(whole_pairs) * kGroupRows + r) * 2 * sizeof(bf16_t), row + k - 1, sizeof(bf16_t));
    }
  }
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    uint8_t* dst = region.values + i * region.values_stride;
    for (int c = 0; c < region.cols; ++c) {
      const int k = region.k0 + c;  // pair k / 2 holds the 16 rows' two values side by side
      std::memcpy(dst + c * sizeof(bf16_t), group + ((size_t(k / 2) * kGroupRows + r) * 2 + k % 2) * sizeof(bf16_t),
                  sizeof(bf16_t));
    }
  }
}

}  // namespace

extern const FormatTraits kBf16Format = {
    .name = "BF16",
    .value_bits = 16,
    .scale_type = ScaleType::kNone,
    .scale_groups = {kEndOfList},
    .k_multiple = 1,
    .max_k = kMaxDimension,
    .activations = ActivationKind::kBf16,
    .group_bytes = group_bytes,
    .group_scale_bytes = group_scale_bytes,
    .pack = pack,
    .unpack = unpack,
    .gemm = &Kernels::bf16,
    .path = &KernelInfo::bf16_path,
};

KT_NAMESPACE_END
