// gemm_int8 of the amx build: AMX-INT8 tiles (tdpbsud: s8 activations x u8 weights) for blocks of 32
// activation rows when k is a multiple of 64, the AVX512 kernel for the rest. The packed INT8 layout
// (kernels.h) is already the tile's B operand: 16 input quads x 16 output rows x 4 bytes = one
// 16 x 64-byte tile per 64 inputs of a group. The int32 sums are corrected for the +128 weight
// offset and scaled after the tiles are stored.
#include <algorithm>

#include "kernels_avx512/vec.h"
#include "tiles.h"

KT_NAMESPACE_BEGIN
namespace amx {
namespace {

constexpr int kInputsPerTile = 64;

// sums[0:32][0:32] for 32 contiguous quantized rows (row stride x_bytes) and groups g, g+1.
void tile_block(const int8_t* x, size_t x_bytes, const uint8_t* group0, const uint8_t* group1, int k, int32_t* sums) {
  block_product(x, x_bytes, group0, group1, k, block_dots_s8u8);
  store_block(sums, 2 * kGroupRows * sizeof(int32_t));
}

}  // namespace

void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  auto avx512 = [&](const Activations& xs, const PackedGroups& ws, float* ys) { avx512::paths().int8(xs, ws, ys, y_stride); };
  if (w.k % kInputsPerTile != 0) return avx512(x, w, y);
  tiles_and_edges(x, w, y, y_stride, [&](int tile_rows, int tile_groups) {
    const TileRows rows = quantized_tile_rows(x, tile_rows, w.k);
    alignas(64) int32_t sums[kBlockRows][kBlockGroups * kGroupRows];
    for (int g = 0; g < tile_groups; g += kBlockGroups) {
      const float* row_scales = reinterpret_cast<const float*>(w.scales + g * w.group_scale_bytes);
      for (int i = 0; i < tile_rows; i += kBlockRows) {
        tile_block(rows.values + size_t(i) * rows.stride, rows.stride, w.values + g * w.group_bytes,
                   w.values + (g + 1) * w.group_bytes, w.k, &sums[0][0]);
        for (int r = 0; r < kBlockRows; ++r) {
          const QuantizedRow row = x.quantized_row(i + r);
          const int32_t offset = kInt8Offset * quantized_sum(row, 0, w.k);
          float* out = y + size_t(i + r) * y_stride + g * kGroupRows;
          // The two groups' scales are consecutive (group_scale_bytes = 16 floats).
          for (int c = 0; c < kBlockGroups * kGroupRows; ++c)
            out[c] = float(sums[r][c] - offset) * row_scales[c] * row.scale;
        }
      }
    }
  }, avx512);
}

}  // namespace amx
KT_NAMESPACE_END
