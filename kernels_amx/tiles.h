// The AMX tile operations the kernels use, twice: on the hardware (intrinsics), and emulated in
// software with the same semantics, so that the tile code is tested on CPUs without AMX (the test
// module built with -DKT_KERNEL_AMX_EMULATION=ON).
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels.h"

KT_NAMESPACE_BEGIN
namespace amx {

// The amx build's tile GEMMs (tile_gemm.cpp; gemm_four_bit.cpp); entry.cpp puts them in the kernel
// table.
void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_fp8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_int4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
// INT4 on the INT8 tiles (int8 activation rows), for what gemm_int4 leaves to it.
void gemm_int4_on_int8_tiles(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);
// The flops of `iterations` rounds of tdpbf16ps on the calling thread (0 on emulated tiles).
double tile_bf16_peak_probe(int64_t iterations);

constexpr int kTileRows = 16;   // rows of the C and A tiles
constexpr int kTileBytes = 64;  // bytes per row: 16 fp32, or 32 bf16 (16 pairs)

// Palette 1: tiles 0-3 (C), 4-5 (A) and 6-7 (B), each 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  constexpr TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = kTileBytes;
      rows[t] = kTileRows;
    }
  }
};

// The one configuration every kernel loads, kept in static memory: GCC 12 does not see that
// ldtilecfg reads all 64 bytes of its operand, and for a configuration built on the stack it kept
// only the stores of the first ten bytes (the peak probe then faulted on AMX hardware).
inline constexpr TileConfig kTileConfig{};

#ifndef KT_AMX_EMULATED
// Hardware tiles. The intrinsics need literal tile numbers, hence macros.
inline void configure_tiles() { _tile_loadconfig(&kTileConfig); }
inline void release_tiles() { _tile_release(); }
#define KT_TILE_ZERO(t) _tile_zero(t)
#define KT_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define KT_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define KT_TILE_DOT_BF16(c, a, b) _tile_dpbf16ps(c, a, b)  // C[m][n] += sum_p A[m][pair p] . B[p][n]
#define KT_TILE_DOT_S8U8(c, a, b) _tile_dpbsud(c, a, b)    // C[m][n] += sum_p s8 A[m][quad p] . u8 B[p][n]
#else
// Software tiles: eight registers of up to 16 x 64 bytes per thread, shaped by the last
// configure_tiles; TDPBF16PS as the ISA reference defines it (fp32 products of bf16 pairs,
// accumulated in order into the fp32 element). A product whose tile shapes do not fit together
// aborts, as the hardware would fault.
struct EmulatedTiles {
  alignas(64) static inline thread_local uint8_t reg[8][kTileRows][kTileBytes];
  static inline thread_local TileConfig config;
  static inline std::atomic<long> products{0};  // tile products run, all threads (the tests check the path ran)

  static void zero(int t) { std::memset(reg[t], 0, sizeof(reg[t])); }
  static void load(int t, const void* base, size_t stride) {
    zero(t);
    for (int r = 0; r < config.rows[t]; ++r)
      std::memcpy(reg[t][r], static_cast<const uint8_t*>(base) + r * stride, config.colsb[t]);
  }
  static void store(int t, void* base, size_t stride) {
    for (int r = 0; r < config.rows[t]; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, reg[t][r], config.colsb[t]);
  }
  // C[m][n] += sum over the A row's 4-byte units p of dot(A[m][p], B[p][n]).
  template <class Dot>
  static void product(int c, int a, int b, Dot dot) {
    const int rows = config.rows[c], units = config.colsb[a] / 4, cols = config.colsb[c] / 4;
    if (config.rows[a] != rows || config.rows[b] != units || config.colsb[b] / 4 != cols) {
      std::fprintf(stderr, "emulated tiles: shapes of tiles %d, %d, %d do not fit\n", c, a, b);
      std::abort();
    }
    ++products;
    for (int m = 0; m < rows; ++m)
      for (int n = 0; n < cols; ++n)
        for (int p = 0; p < units; ++p) dot(&reg[c][m][4 * n], &reg[a][m][4 * p], &reg[b][p][4 * n]);
  }
  static void dot_bf16(int c, int a, int b) {
    product(c, a, b, [](uint8_t* acc, const uint8_t* x, const uint8_t* w) {
      float sum;
      std::memcpy(&sum, acc, sizeof(sum));
      for (int h = 0; h < 2; ++h) sum += bf16_at(x, h) * bf16_at(w, h);
      std::memcpy(acc, &sum, sizeof(sum));
    });
  }
  static void dot_s8u8(int c, int a, int b) {  // TDPBSUD: int32 sums of s8 (A) x u8 (B) quads
    product(c, a, b, [](uint8_t* acc, const uint8_t* x, const uint8_t* w) {
      int32_t sum;
      std::memcpy(&sum, acc, sizeof(sum));
      for (int h = 0; h < 4; ++h) sum += int8_t(x[h]) * int32_t(w[h]);
      std::memcpy(acc, &sum, sizeof(sum));
    });
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
inline void configure_tiles() { EmulatedTiles::config = kTileConfig; }
inline void release_tiles() {}
#define KT_TILE_ZERO(t) amx::EmulatedTiles::zero(t)
#define KT_TILE_LOAD(t, base, stride) amx::EmulatedTiles::load(t, base, stride)
#define KT_TILE_STORE(t, base, stride) amx::EmulatedTiles::store(t, base, stride)
#define KT_TILE_DOT_BF16(c, a, b) amx::EmulatedTiles::dot_bf16(c, a, b)
#define KT_TILE_DOT_S8U8(c, a, b) amx::EmulatedTiles::dot_s8u8(c, a, b)

#endif

// The first `rows` quantized rows of x as the tiles load them, one stride apart: x's own rows, or
// routed rows gathered into x.scratch (`scratch_bytes` of it then taken).
struct TileRows {
  const int8_t* values;
  size_t stride;
  size_t scratch_bytes;
};
inline TileRows quantized_tile_rows(const Activations& x, int rows, int k) {
  if (x.row_ids == nullptr) return {x.quantized.values, x.quantized.stride, 0};
  int8_t* gathered = reinterpret_cast<int8_t*>(x.scratch);
  for (int i = 0; i < rows; ++i) std::memcpy(gathered + size_t(i) * k, x.quantized_row(i).values, k);
  return {gathered, size_t(k), size_t(rows) * k};
}

// Lines of two weight streams to prefetch into L2 while a block product runs, spread over its
// steps: `per_step` bytes of each from `first` on.
struct StreamPrefetch {
  const uint8_t* b0 = nullptr;
  const uint8_t* b1 = nullptr;
  size_t first = 0, per_step = 0;
};

// The block product of every tile kernel: C tiles 0-3 (A rows 0-15 / 16-31 x B 0 / 1) += the sum over
// steps of A (tiles 4, 5: 32 rows of x, row stride x_bytes, 64 bytes of each per step, `bytes` in
// all) times B (tiles 6, 7 from b0, b1: 16 rows of 64 bytes per step). `dots()` runs the four tile
// products (block_dots_*); `next`'s lines are prefetched meanwhile.
template <class Dots>
void add_block_product(const void* x, size_t x_bytes, const uint8_t* b0, const uint8_t* b1, size_t bytes, Dots dots,
                       StreamPrefetch next = {}) {
  const uint8_t* a = static_cast<const uint8_t*>(x);
  size_t ahead = next.first;
  for (size_t offset = 0; offset < bytes; offset += kTileBytes) {
    for (const size_t end = ahead + next.per_step; ahead < end; ahead += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(next.b0 + ahead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next.b1 + ahead), _MM_HINT_T1);
    }
    KT_TILE_LOAD(4, a + offset, x_bytes);
    KT_TILE_LOAD(5, a + kTileRows * x_bytes + offset, x_bytes);
    KT_TILE_LOAD(6, b0 + kTileRows * offset, kTileBytes);
    KT_TILE_LOAD(7, b1 + kTileRows * offset, kTileBytes);
    dots();
  }
}

// The same from C = 0.
template <class Dots>
void block_product(const void* x, size_t x_bytes, const uint8_t* b0, const uint8_t* b1, size_t bytes, Dots dots) {
  KT_TILE_ZERO(0);
  KT_TILE_ZERO(1);
  KT_TILE_ZERO(2);
  KT_TILE_ZERO(3);
  add_block_product(x, x_bytes, b0, b1, bytes, dots);
}

// The four tile products of a block, for block_product.
inline void block_dots_bf16() {
  KT_TILE_DOT_BF16(0, 4, 6);
  KT_TILE_DOT_BF16(1, 4, 7);
  KT_TILE_DOT_BF16(2, 5, 6);
  KT_TILE_DOT_BF16(3, 5, 7);
}
inline void block_dots_s8u8() {
  KT_TILE_DOT_S8U8(0, 4, 6);
  KT_TILE_DOT_S8U8(1, 4, 7);
  KT_TILE_DOT_S8U8(2, 5, 6);
  KT_TILE_DOT_S8U8(3, 5, 7);
}

// Stores C tiles 0-3 (16 x 16 fp32 or int32 each) as one 32 x 32 block at out (row stride out_bytes).
inline void store_block(void* out, size_t out_bytes) {
  uint8_t* c = static_cast<uint8_t*>(out);
  KT_TILE_STORE(0, c, out_bytes);
  KT_TILE_STORE(1, c + kTileBytes, out_bytes);
  KT_TILE_STORE(2, c + kTileRows * out_bytes, out_bytes);
  KT_TILE_STORE(3, c + kTileRows * out_bytes + kTileBytes, out_bytes);
}

// Loads C tiles 0-3 from a 32 x 32 block at `in` (row stride in_bytes): store_block's inverse.
inline void load_block(const void* in, size_t in_bytes) {
  const uint8_t* c = static_cast<const uint8_t*>(in);
  KT_TILE_LOAD(0, c, in_bytes);
  KT_TILE_LOAD(1, c + kTileBytes, in_bytes);
  KT_TILE_LOAD(2, c + kTileRows * in_bytes, in_bytes);
  KT_TILE_LOAD(3, c + kTileRows * in_bytes + kTileBytes, in_bytes);
}

// The tile kernels cover blocks of kBlockRows activation rows x kBlockGroups groups; `tiles(rows,
// groups)` runs them, with the tiles configured, on the largest such block of x and w,
// `fallback(x, w, y)` (the AVX512 kernel) on what is left: the last odd group of the tiled rows, and
// the rows below a whole block.
constexpr int kBlockRows = 2 * kTileRows, kBlockGroups = 2;

template <class Tiles, class Fallback>
void tiles_and_edges(const Activations& x, const PackedGroups& w, float* y, size_t y_stride, Tiles tiles,
                     Fallback fallback) {
  const int tile_rows = x.rows / kBlockRows * kBlockRows, tile_groups = w.groups / kBlockGroups * kBlockGroups;
  if (tile_rows == 0 || tile_groups == 0) return fallback(x, w, y);
  configure_tiles();
  tiles(tile_rows, tile_groups);
  release_tiles();
  if (tile_groups < w.groups) {
    PackedGroups last = w;
    last.values += tile_groups * w.group_bytes;
    last.scales += tile_groups * w.group_scale_bytes;
    if (w.zeros != nullptr) last.zeros += tile_groups * w.group_zero_bytes;
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
                          x.quantized.running_sums + size_t(tile_rows) * running_sums_per_row(x.quantized.stride),
                          x.quantized.stride, x.quantized.parts};
    }
    fallback(rest, w, y + size_t(tile_rows) * y_stride);
  }
}

}  // namespace amx
KT_NAMESPACE_END
