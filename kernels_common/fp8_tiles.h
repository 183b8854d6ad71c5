// FP8 register tiles for the AVX2 and AVX512 builds, and their two drivers:
//  - few activation rows (decode, memory-bound): the tiles decode the E4M3 codes in registers, so
//    each code is read once from DRAM and nothing goes through memory; every scale block's sums
//    stay in registers and are scaled there;
//  - many rows (prefill): per few groups x one scale block, the first tile of rows decodes the codes
//    as it multiplies and leaves them on the stack, the other tiles of rows read them there; each
//    adds its scaled product of the block to y. The avx512 BF16 format on fp32 FMA takes this
//    driver too: its "codes" are its bf16 values, which the later tiles then read widened.
//
// P (one bf16 multiply path of a build: vdpbf16ps, or fp32 FMA on widened bf16) provides the vector
// traits of int_tiles.h that the tiles use (Float, kLanes, load_ps, loadu_ps, set1_ps, fmadd, mul,
// storeu_ps) and:
//   Row: an activation row handle; Act act(Row x, int p): inputs 2p, 2p + 1 of a row;
//   Bits decode_bits(const uint8_t* codes): 2 * kLanes packed codes (kLanes rows x one input pair)
//   as bf16 (a vector of them in the BF16 layout); Line line_of(Bits): the operand(s) dot takes;
//   Float dot(Float acc, const Line&, const Act&): acc + the kLanes rows' products;
//   kCodeBytes: bytes per weight in w.values (FP8 1, BF16 2); kScaled: whether w has scale blocks;
//   Stored: what the stack driver keeps per weight (bf16_t, or float where the multiply takes fp32:
//   the later tiles then load each line as it is instead of widening it again); store_line(Stored*,
//   Bits, const Line&) and Line load_line(const Stored*): one decoded line, 2 * kLanes Stored.
#pragma once

#include <algorithm>
#include <array>
#include <utility>

#include "fp8_via_bf16.h"
#include "gemm_tiles.h"

KT_NAMESPACE_BEGIN

// kFromCodes: the tile reads packed codes, else decoded bf16 lines. kAddToY: y += the tile's
// product (the later blocks of the stack driver).
template <class P, bool kFromCodes, bool kAddToY = false>
struct Fp8Tiles {
  using Float = typename P::Float;
  using Row = typename P::Row;
  static constexpr int kVecsPerGroup = kGroupRows / P::kLanes;
  using Stored = typename P::Stored;
  static constexpr int kLineBytesPerWeight = kFromCodes ? P::kCodeBytes : int(sizeof(Stored));

  template <int M, int NV>
  struct Tile {
    static constexpr int kVecs = NV * kVecsPerGroup;

    // Vector v: group v / kVecsPerGroup, rows (v % kVecsPerGroup) * kLanes onwards. With `store`
    // (codes only), the decoded line is also written there (store_line), store_group_elems Stored
    // per group.
    static typename P::Line line(const PackedGroups& w, int v, int p, Stored* store, size_t store_group_elems) {
      const int part = v % kVecsPerGroup;
      const size_t offset = size_t(p) * kGroupRows + part * P::kLanes;  // in pairs
      const uint8_t* at = w.values + (v / kVecsPerGroup) * w.group_bytes + offset * 2 * kLineBytesPerWeight;
      if constexpr (kFromCodes) {
        if (part == 0) prefetch_weights(w, v / kVecsPerGroup, at);  // one pair of a group (FP8 32 bytes, BF16 64): one prefetch
        const typename P::Bits bits = P::decode_bits(at);
        const typename P::Line decoded = P::line_of(bits);
        if (store != nullptr) P::store_line(store + (v / kVecsPerGroup) * store_group_elems + offset * 2, bits, decoded);
        return decoded;
      } else {
        return P::load_line(reinterpret_cast<const Stored*>(at));
      }
    }
    static Float scale(const PackedGroups& w, int v, int block) {
      return P::load_ps(reinterpret_cast<const float*>(w.scales + (v / kVecsPerGroup) * w.group_scale_bytes) +
                        block * kGroupRows + (v % kVecsPerGroup) * P::kLanes);
    }
    // sums[i][v] = the products of input pairs [p0, p1).
    static void block_sums(const Row* x, const PackedGroups& w, int p0, int p1, Float (&sums)[M][kVecs],
                           Stored* store = nullptr) {
      const size_t store_group_elems = size_t(p1 - p0) * 2 * kGroupRows;
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < kVecs; ++v) sums[i][v] = P::set1_ps(0.0f);
      // A do-while (p1 > p0 always): GCC 12 keeps the sums of a loop that may run zero times in
      // memory, stored and reloaded around it every block.
      int p = p0;
      do {
        typename P::Line lines[kVecs];
        for (int v = 0; v < kVecs; ++v) lines[v] = line(w, v, p, store, store_group_elems);
        for (int i = 0; i < M; ++i) {
          const typename P::Act a = P::act(x[i], p);
          for (int v = 0; v < kVecs; ++v) sums[i][v] = P::dot(sums[i][v], lines[v], a);
        }
      } while (++p < p1);
    }

    // Every scale block of w.k (the codes, in registers): gemm_tiled's tile.
    static void run(const Row* x, const PackedGroups& w, float* y, size_t y_stride) {
      const int pairs = round_up(w.k, 2) / 2;
      const int block_pairs = w.scale_group > 0 ? w.scale_group / 2 : pairs;
      Float sums[M][kVecs], acc[M][kVecs];
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < kVecs; ++v) acc[i][v] = P::set1_ps(0.0f);
      for (int p0 = 0, block = 0; p0 < pairs; p0 += block_pairs, ++block) {
        block_sums(x, w, p0, std::min(pairs, p0 + block_pairs), sums);
        for (int v = 0; v < kVecs; ++v) {
          const Float s = scale(w, v, block);
          for (int i = 0; i < M; ++i) acc[i][v] = P::fmadd(sums[i][v], s, acc[i][v]);
        }
      }
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < kVecs; ++v) P::storeu_ps(y + i * y_stride + v * P::kLanes, acc[i][v]);
    }

    // w.k inputs under one scale (w.scale_group 0): the stack driver's tile. `store`: see line().
    static void run_block(const Row* x, const PackedGroups& w, Stored* store, float* y, size_t y_stride) {
      Float sums[M][kVecs];
      block_sums(x, w, 0, round_up(w.k, 2) / 2, sums, store);
      Float scales[kVecs];  // loaded before the stores to y, which the compiler must assume alias them
      for (int v = 0; v < kVecs; ++v) scales[v] = P::kScaled ? scale(w, v, 0) : P::set1_ps(1.0f);
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < kVecs; ++v) {
          float* out = y + i * y_stride + v * P::kLanes;
          if constexpr (kAddToY)
            P::storeu_ps(out, P::fmadd(sums[i][v], scales[v], P::loadu_ps(out)));
          else
            P::storeu_ps(out, P::mul(sums[i][v], scales[v]));
        }
    }
  };

  // run_block of Tile<M, NV> for M = 1..MaxM, NV = 1..MaxNV, at [(M - 1) * MaxNV + NV - 1].
  using BlockFn = void (*)(const Row*, const PackedGroups&, Stored*, float*, size_t);
  template <int MaxM, int MaxNV, size_t... I>
  static constexpr std::array<BlockFn, sizeof...(I)> block_table(std::index_sequence<I...>) {
    return {{&Tile<int(I / MaxNV) + 1, int(I % MaxNV) + 1>::run_block...}};
  }
  template <int MaxM, int MaxNV>
  static constexpr std::array<BlockFn, MaxM * MaxNV> kBlockTable =
      block_table<MaxM, MaxNV>(std::make_index_sequence<MaxM * MaxNV>{});
};

// Few rows: codes decoded in the tiles' registers. row_of(i) -> P::Row.
template <class P, int MaxM, int NV, class RowOf>
void gemm_fp8_in_registers(RowOf row_of, int rows, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<Fp8Tiles<P, true>::template Tile, MaxM, NV, typename P::Row>(row_of, rows, w, y, y_stride);
}

// Many rows: NV groups x one scale block at a time. The first tile of rows decodes the codes as it
// multiplies and leaves them on the stack (NV x 4 KiB as bf16, 8 KiB as fp32), so the decoding
// overlaps its multiply-adds; the other tiles of rows read them there.
template <class P, int MaxM, int NV, class RowOf>
void gemm_lines_on_stack(RowOf row_of, int rows, const PackedGroups& w, float* y, size_t y_stride) {
  alignas(64) typename P::Stored decoded[NV * kGroupRows * kFp8Block];
  const int block = w.scale_group > 0 ? w.scale_group : kFp8Block;
  const int k_even = round_up(w.k, 2);
  const int row_blocks = ceil_div(rows, MaxM);  // of near-equal size, as gemm_tiled makes them
  for (int g0 = 0; g0 < w.groups; g0 += NV) {
    const int groups = std::min(NV, w.groups - g0);
    for (int k0 = 0; k0 < k_even; k0 += block) {
      const int inputs = std::min(block, k_even - k0);  // even
      const int scale_index = w.scale_group > 0 ? k0 / w.scale_group : 0;
      const uint8_t* scales =
          P::kScaled ? w.scales + size_t(g0) * w.group_scale_bytes + scale_index * kGroupRows * sizeof(float) : nullptr;
      const PackedGroups codes{w.values + size_t(g0) * w.group_bytes + size_t(k0) * kGroupRows * P::kCodeBytes, scales,
                               w.group_bytes, w.group_scale_bytes, inputs, groups};
      const PackedGroups stored{reinterpret_cast<const uint8_t*>(decoded), scales,
                                size_t(inputs) * kGroupRows * sizeof(decoded[0]), w.group_scale_bytes, inputs, groups};
      for (int b = 0, i0 = 0; b < row_blocks; ++b) {
        const int mm = ceil_div(rows - i0, row_blocks - b);
        typename P::Row x[MaxM];
        for (int i = 0; i < mm; ++i) x[i] = row_of(i0 + i) + k0;
        const size_t at = size_t(mm - 1) * NV + (groups - 1);
        float* y_block = y + size_t(i0) * y_stride + g0 * kGroupRows;
        if (b == 0)
          (k0 == 0 ? Fp8Tiles<P, true>::template kBlockTable<MaxM, NV>
                   : Fp8Tiles<P, true, true>::template kBlockTable<MaxM, NV>)[at](x, codes, decoded, y_block, y_stride);
        else
          (k0 == 0 ? Fp8Tiles<P, false>::template kBlockTable<MaxM, NV>
                   : Fp8Tiles<P, false, true>::template kBlockTable<MaxM, NV>)[at](x, stored, nullptr, y_block, y_stride);
        i0 += mm;
      }
    }
  }
}

// The FP8 GEMM of one path: in registers up to `Few` rows (Few x FewGroups tiles; more rows would
// decode each code again per tile), else through the stack (Many x ManyGroups tiles).
template <class P, int Few, int FewGroups, int Many, int ManyGroups, class RowOf>
void gemm_fp8(RowOf row_of, int rows, const PackedGroups& w, float* y, size_t y_stride) {
  if (rows <= Few)
    gemm_fp8_in_registers<P, Few, FewGroups>(row_of, rows, w, y, y_stride);
  else
    gemm_lines_on_stack<P, Many, ManyGroups>(row_of, rows, w, y, y_stride);
}

KT_NAMESPACE_END
