// The AMX tile operations the kernels use, twice: on the hardware (intrinsics), and emulated in
// software with the same semantics, so that the tile code is tested on CPUs without AMX (the test
// module built with -DKT_KERNEL_AMX_EMULATION=ON).
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstring>

#include "kernels.h"

KT_NAMESPACE_BEGIN
namespace amx {

// The amx build's tile GEMMs (gemm_bf16.cpp, gemm_int8.cpp); entry.cpp puts them in the kernel table.
void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);

constexpr int kTileRows = 16;   // rows of every tile used here
constexpr int kTileBytes = 64;  // bytes per row: 16 fp32, or 32 bf16 (16 pairs)

// Palette 1 with tiles 0-7 all 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {kTileBytes, kTileBytes, kTileBytes, kTileBytes, kTileBytes, kTileBytes, kTileBytes, kTileBytes};
  uint8_t rows[16] = {kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows, kTileRows};
};

#ifndef KT_AMX_EMULATED
// Hardware tiles. The intrinsics need literal tile numbers, hence macros.
inline void configure_tiles(const TileConfig& config) { _tile_loadconfig(&config); }
inline void release_tiles() { _tile_release(); }
#define KT_TILE_ZERO(t) _tile_zero(t)
#define KT_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define KT_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define KT_TILE_DOT_BF16(c, a, b) _tile_dpbf16ps(c, a, b)  // C[m][n] += sum_p A[m][pair p] . B[p][n]
#define KT_TILE_DOT_S8U8(c, a, b) _tile_dpbsud(c, a, b)    // C[m][n] += sum_p s8 A[m][quad p] . u8 B[p][n]
#else
// Software tiles: eight 16 x 64-byte registers per thread; TDPBF16PS as the ISA reference defines it
// (fp32 products of bf16 pairs, accumulated in order into the fp32 element).
struct EmulatedTiles {
  alignas(64) static inline thread_local uint8_t reg[8][kTileRows][kTileBytes];
  static inline std::atomic<long> products{0};  // tile products run, all threads (the tests check the path ran)

  static void zero(int t) { std::memset(reg[t], 0, sizeof(reg[t])); }
  static void load(int t, const void* base, size_t stride) {
    for (int r = 0; r < kTileRows; ++r) std::memcpy(reg[t][r], static_cast<const uint8_t*>(base) + r * stride, kTileBytes);
  }
  static void store(int t, void* base, size_t stride) {
    for (int r = 0; r < kTileRows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, reg[t][r], kTileBytes);
  }
  static void dot_bf16(int c, int a, int b) {
    ++products;
    for (int m = 0; m < kTileRows; ++m)
      for (int n = 0; n < kTileRows; ++n) {
        float sum;
        std::memcpy(&sum, &reg[c][m][4 * n], sizeof(sum));
        for (int p = 0; p < kTileRows; ++p)
          for (int h = 0; h < 2; ++h) sum += bf16_at(reg[a][m], 2 * p + h) * bf16_at(reg[b][p], 2 * n + h);
        std::memcpy(&reg[c][m][4 * n], &sum, sizeof(sum));
      }
  }
  static void dot_s8u8(int c, int a, int b) {  // TDPBSUD: int32 sums of s8 (A) x u8 (B) quads
    ++products;
    for (int m = 0; m < kTileRows; ++m)
      for (int n = 0; n < kTileRows; ++n) {
        int32_t sum;
        std::memcpy(&sum, &reg[c][m][4 * n], sizeof(sum));
        for (int p = 0; p < kTileRows; ++p)
          for (int h = 0; h < 4; ++h) sum += int8_t(reg[a][m][4 * p + h]) * int32_t(reg[b][p][4 * n + h]);
        std::memcpy(&reg[c][m][4 * n], &sum, sizeof(sum));
      }
  }

 private:
  static float bf16_at(const uint8_t* row, int index) {
    uint16_t bits;
    std::memcpy(&bits, row + 2 * index, sizeof(bits));
    const uint32_t wide = uint32_t(bits) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof(value));
    return value;
  }
};
inline void configure_tiles(const TileConfig&) {}
inline void release_tiles() {}
#define KT_TILE_ZERO(t) amx::EmulatedTiles::zero(t)
#define KT_TILE_LOAD(t, base, stride) amx::EmulatedTiles::load(t, base, stride)
#define KT_TILE_STORE(t, base, stride) amx::EmulatedTiles::store(t, base, stride)
#define KT_TILE_DOT_BF16(c, a, b) amx::EmulatedTiles::dot_bf16(c, a, b)
#define KT_TILE_DOT_S8U8(c, a, b) amx::EmulatedTiles::dot_s8u8(c, a, b)

#endif

// The tile kernels cover blocks of kBlockRows activation rows x kBlockGroups groups; `tiles(rows,
// groups)` runs them on the largest such block of x and w, `fallback(x, w, y)` (the AVX512 kernel)
// on what is left: the last odd group of the tiled rows, and the rows below a whole block.
constexpr int kBlockRows = 2 * kTileRows, kBlockGroups = 2;

template <class Tiles, class Fallback>
void tiles_and_edges(const Activations& x, const PackedGroups& w, float* y, size_t y_stride, Tiles tiles,
                     Fallback fallback) {
  const int tile_rows = x.rows / kBlockRows * kBlockRows, tile_groups = w.groups / kBlockGroups * kBlockGroups;
  if (tile_rows == 0 || tile_groups == 0) return fallback(x, w, y);
  static const TileConfig config;
  configure_tiles(config);
  tiles(tile_rows, tile_groups);
  release_tiles();
  if (tile_groups < w.groups) {
    PackedGroups last = w;
    last.values += tile_groups * w.group_bytes;
    last.scales += tile_groups * w.group_scale_bytes;
    last.groups = w.groups - tile_groups;
    Activations tiled = x;
    tiled.rows = tile_rows;
    fallback(tiled, last, y + tile_groups * kGroupRows);
  }
  if (tile_rows < x.rows) {
    Activations rest = x;
    rest.rows = x.rows - tile_rows;
    if (x.row_ids != nullptr) {
      rest.row_ids += tile_rows;
    } else {
      rest.base += size_t(tile_rows) * x.stride;
      if (x.quantized.values != nullptr)
        rest.quantized = {x.quantized.values + size_t(tile_rows) * x.quantized.stride,
                          x.quantized.scales + tile_rows,
                          x.quantized.block_sums + size_t(tile_rows) * x.quantized.stride / kActivationBlock,
                          x.quantized.stride};
    }
    fallback(rest, w, y + size_t(tile_rows) * y_stride);
  }
}

}  // namespace amx
KT_NAMESPACE_END
