// Unpacking from the layouts described in kernels.h (shared by every build). Row by row: the 16
// rows of a packed group read the same lines, which stay in cache between them.
#include "unpack.h"

#include <cstring>

KT_NAMESPACE_BEGIN
namespace {

// The packed group holding `row`, and the row's index in it.
struct GroupRow {
  const uint8_t* values;
  const uint8_t* scales;
  int r;
};

GroupRow group_row(const PackedGroups& w, int row) {
  const size_t g = size_t(row / kGroupRows);
  return {w.values + g * w.group_bytes, w.scales + g * w.group_scale_bytes, row % kGroupRows};
}

void store_float(uint8_t* dst, float value) { std::memcpy(dst, &value, sizeof(value)); }

}  // namespace

void unpack_bf16(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const GroupRow g = group_row(w, region.row0 + i);
    uint8_t* dst = region.values + i * region.values_stride;
    for (int c = 0; c < region.cols; ++c) {
      const int k = region.k0 + c;  // pair k / 2 holds the 16 rows' two values side by side
      std::memcpy(dst + c * sizeof(bf16_t), g.values + ((size_t(k / 2) * kGroupRows + g.r) * 2 + k % 2) * sizeof(bf16_t),
                  sizeof(bf16_t));
    }
  }
}

void unpack_mxfp4(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const GroupRow g = group_row(w, region.row0 + i);
    uint8_t* dst = region.values + i * region.values_stride;
    for (int j = 0; j < region.cols / 2; ++j) {  // canonical byte = codes of inputs 2j (low), 2j + 1
      const int byte = region.k0 / 2 + j, shift = 4 * (byte % 4);
      uint32_t word;
      std::memcpy(&word, g.values + (byte / 4) * kMxfp4ChunkBytes + 4 * g.r, sizeof(word));
      dst[j] = uint8_t(((word >> shift) & 0xF) | ((word >> (16 + shift)) & 0xF) << 4);
    }
    uint8_t* scales = region.scales + i * region.scales_stride;
    for (int b = 0; b < region.cols / kMxfp4Block; ++b)
      scales[b] = g.scales[(region.k0 / kMxfp4Block + b) * kGroupRows + g.r];
  }
}

void unpack_int8(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const GroupRow g = group_row(w, region.row0 + i);
    uint8_t* dst = region.values + i * region.values_stride;
    for (int c = 0; c < region.cols; ++c) {
      const int k = region.k0 + c;
      dst[c] = uint8_t(g.values[(k / 4) * 64 + 4 * g.r + k % 4] - kInt8Offset);  // stored as q + 128
    }
    float scale;
    std::memcpy(&scale, g.scales + g.r * sizeof(float), sizeof(scale));
    store_float(region.scales + i * region.scales_stride, scale);
  }
}

void unpack_int4(const PackedGroups& w, const UnpackRegion& region) {
  auto nibble = [](const GroupRow& g, int k) {  // two's complement, as canonical bytes hold it
    const int stored = (g.values[(k / 8) * 64 + 4 * g.r + k % 4] >> (4 * ((k % 8) / 4))) & 0xF;
    return stored ^ kInt4Offset;  // stored as q + 8
  };
  for (int i = 0; i < region.rows; ++i) {
    const GroupRow g = group_row(w, region.row0 + i);
    uint8_t* dst = region.values + i * region.values_stride;
    for (int j = 0; j < region.cols / 2; ++j) {
      const int k = region.k0 + 2 * j;
      dst[j] = uint8_t(nibble(g, k) | nibble(g, k + 1) << 4);
    }
    uint8_t* scales = region.scales + i * region.scales_stride;
    for (int s = 0; s < region.cols / w.scale_group; ++s) {
      float scale;
      std::memcpy(&scale, g.scales + (size_t(region.k0 / w.scale_group + s) * kGroupRows + g.r) * sizeof(float),
                  sizeof(scale));
      store_float(scales + s * sizeof(float), scale);
    }
  }
}

KT_NAMESPACE_END
