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
  block_product(x, x_bytes, group0, group1, size_t(k) * sizeof(bf16_t), block_dots_bf16);
  store_block(y, y_stride * sizeof(float));
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

double tile_bf16_peak_probe(int64_t iterations) {
#ifdef KT_AMX_EMULATED
  (void)iterations;
  return 0.0;  // software tiles have no peak worth reporting
#else
  // Four independent C tiles, A and B loaded once (zeros: the rate does not depend on the values).
  alignas(64) static const uint8_t zeros[kTileRows * kTileBytes] = {};
  configure_tiles();
  KT_TILE_ZERO(0);
  KT_TILE_ZERO(1);
  KT_TILE_ZERO(2);
  KT_TILE_ZERO(3);
  KT_TILE_LOAD(4, zeros, kTileBytes);
  KT_TILE_LOAD(5, zeros, kTileBytes);
  KT_TILE_LOAD(6, zeros, kTileBytes);
  KT_TILE_LOAD(7, zeros, kTileBytes);
  const int64_t rounds = std::max<int64_t>(iterations / 4, 1);
  for (int64_t i = 0; i < rounds; ++i) block_dots_bf16();
  release_tiles();
  constexpr double kFlopsPerProduct = 2.0 * kTileRows * kTileRows * 2 * kTileRows;  // 16 x 16 outputs, 32 inputs
  return double(rounds) * 4 * kFlopsPerProduct;
#endif
}

}  // namespace amx
KT_NAMESPACE_END
