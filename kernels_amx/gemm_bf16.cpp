// gemm_bf16 of the amx build: AMX-BF16 tiles for blocks of 32 activation rows when k is a multiple
// of 32, the AVX512 kernel for the rest. The packed BF16 layout (kernels.h) is already the tile's
// B operand: 16 input pairs x 16 output rows x 2 = one 16 x 64-byte tile per 32 inputs of a group.
#include <algorithm>

#include "kernels_avx512/vec.h"
#include "tiles.h"

KT_NAMESPACE_BEGIN
namespace amx {
namespace {

constexpr int kTokenBlock = kBlockRows;  // two A tiles
constexpr int kGroupBlock = kBlockGroups;  // two B tiles: C tiles 0-3 cover 32 tokens x 32 outputs
constexpr int kInputsPerTile = 2 * kTileRows;

// y[0:32][0:32] for 32 contiguous activation rows (row stride x_bytes) and groups g, g+1.
void tile_block(const uint8_t* x, size_t x_bytes, const uint8_t* group0, const uint8_t* group1, int k, float* y,
                size_t y_stride) {
  // Tiles 0-3: C (tokens 0-15 / 16-31 x groups 0 / 1); 4-5: A (activations); 6-7: B (weights).
  KT_TILE_ZERO(0);
  KT_TILE_ZERO(1);
  KT_TILE_ZERO(2);
  KT_TILE_ZERO(3);
  for (int k0 = 0; k0 < k; k0 += kInputsPerTile) {
    KT_TILE_LOAD(4, x + k0 * sizeof(bf16_t), x_bytes);
    KT_TILE_LOAD(5, x + kTileRows * x_bytes + k0 * sizeof(bf16_t), x_bytes);
    KT_TILE_LOAD(6, group0 + size_t(k0 / 2) * kTileBytes, kTileBytes);
    KT_TILE_LOAD(7, group1 + size_t(k0 / 2) * kTileBytes, kTileBytes);
    KT_TILE_DOT_BF16(0, 4, 6);
    KT_TILE_DOT_BF16(1, 4, 7);
    KT_TILE_DOT_BF16(2, 5, 6);
    KT_TILE_DOT_BF16(3, 5, 7);
  }
  const size_t y_bytes = y_stride * sizeof(float);
  KT_TILE_STORE(0, y, y_bytes);
  KT_TILE_STORE(1, y + kGroupRows, y_bytes);
  KT_TILE_STORE(2, y + kTileRows * y_stride, y_bytes);
  KT_TILE_STORE(3, y + kTileRows * y_stride + kGroupRows, y_bytes);
}

}  // namespace

void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  auto avx512 = [&](const Activations& xs, const PackedGroups& ws, float* ys) { avx512::paths().bf16(xs, ws, ys, y_stride); };
  if (w.k % kInputsPerTile != 0) return avx512(x, w, y);
  tiles_and_edges(x, w, y, y_stride, [&](int tile_rows, int tile_groups) {
    // Tiles load rows with one stride: gather routed rows into a contiguous block first.
    const bf16_t* rows = x.base;
    size_t row_elems = x.stride;
    if (x.row_ids != nullptr) {
      bf16_t* gathered = reinterpret_cast<bf16_t*>(x.scratch);
      for (int i = 0; i < tile_rows; ++i) std::memcpy(gathered + size_t(i) * w.k, x.row(i), w.k * sizeof(bf16_t));
      rows = gathered;
      row_elems = w.k;
    }
    for (int g = 0; g < tile_groups; g += kGroupBlock)
      for (int i = 0; i < tile_rows; i += kTokenBlock)
        tile_block(reinterpret_cast<const uint8_t*>(rows + size_t(i) * row_elems), row_elems * sizeof(bf16_t),
                   w.values + g * w.group_bytes, w.values + (g + 1) * w.group_bytes, w.k,
                   y + size_t(i) * y_stride + g * kGroupRows, y_stride);
  }, avx512);
}

}  // namespace amx
KT_NAMESPACE_END
