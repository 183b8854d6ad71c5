// FP8 register tiles for the AVX2 and AVX512 builds, and their two drivers:
//  - few activation rows (decode, memory-bound): the tiles decode the E4M3 codes in registers, so
//    each code is read once from DRAM and nothing goes through memory; every scale block's sums
//    stay in registers and are scaled there;
//  - many rows (prefill): a few groups x one scale block are decoded to the stack once, and tiles
//    over all the rows add that block's scaled product to y.
//
// P (one bf16 multiply path of a build: vdpbf16ps, or fp32 FMA on widened bf16) provides the vector
// traits of int_tiles.h that the tiles use (Float, kLanes, load_ps, set1_ps, fmadd, storeu_ps) and:
//   Row: an activation row handle; Act act(Row x, int p): inputs 2p, 2p + 1 of a row;
//   Line from_codes(const uint8_t* codes): 2 * kLanes packed codes (kLanes rows x one input pair);
//   Line from_bf16(const bf16_t* line): the same, already decoded to the BF16 layout;
//   Float dot(Float acc, const Line&, const Act&): acc + the kLanes rows' products.
#pragma once

#include <algorithm>

#include "fp8_via_bf16.h"
#include "gemm_tiles.h"

KT_NAMESPACE_BEGIN

// kFromCodes: the tile reads packed codes (every scale block of w.k), else decoded bf16 (w holds
// one block: scale_group 0). kAddToY: y += the tile's product (the later blocks of the stack driver).
template <class P, bool kFromCodes, bool kAddToY = false>
struct Fp8Tiles {
  using Float = typename P::Float;
  static constexpr int kVecsPerGroup = kGroupRows / P::kLanes;
  static constexpr int kValueBytes = kFromCodes ? 1 : int(sizeof(bf16_t));

  template <int M, int NV>
  struct Tile {
    static constexpr int kVecs = NV * kVecsPerGroup;

    // Vector v: group v / kVecsPerGroup, rows (v % kVecsPerGroup) * kLanes onwards.
    static typename P::Line line(const PackedGroups& w, int v, int p) {
      const int part = v % kVecsPerGroup;
      const uint8_t* at = w.values + (v / kVecsPerGroup) * w.group_bytes +
                          (size_t(p) * kGroupRows + part * P::kLanes) * 2 * kValueBytes;
      if constexpr (kFromCodes) {
        if (part == 0) prefetch_weights(w, at);  // one pair of a group: 32 bytes, one prefetch
        return P::from_codes(at);
      } else {
        return P::from_bf16(reinterpret_cast<const bf16_t*>(at));
      }
    }
    static Float scale(const PackedGroups& w, int v, int block) {
      return P::load_ps(reinterpret_cast<const float*>(w.scales + (v / kVecsPerGroup) * w.group_scale_bytes) +
                        block * kGroupRows + (v % kVecsPerGroup) * P::kLanes);
    }
    // sums[i][v] = the products of input pairs [p0, p1).
    static void block_sums(const typename P::Row* x, const PackedGroups& w, int p0, int p1, Float (&sums)[M][kVecs]) {
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < kVecs; ++v) sums[i][v] = P::set1_ps(0.0f);
      for (int p = p0; p < p1; ++p) {
        typename P::Line lines[kVecs];
        for (int v = 0; v < kVecs; ++v) lines[v] = line(w, v, p);
        for (int i = 0; i < M; ++i) {
          const typename P::Act a = P::act(x[i], p);
          for (int v = 0; v < kVecs; ++v) sums[i][v] = P::dot(sums[i][v], lines[v], a);
        }
      }
    }
    static Float added(Float product, const float* y) {
      if constexpr (kAddToY) return P::add_ps(product, P::loadu_ps(y));
      return product;
    }

    static void run(const typename P::Row* x, const PackedGroups& w, float* y, size_t y_stride) {
      const int pairs = round_up(w.k, 2) / 2;
      Float sums[M][kVecs];
      if constexpr (!kFromCodes) {  // one block
        block_sums(x, w, 0, pairs, sums);
        for (int v = 0; v < kVecs; ++v) {
          const Float s = scale(w, v, 0);
          for (int i = 0; i < M; ++i) {
            float* out = y + i * y_stride + v * P::kLanes;
            P::storeu_ps(out, added(P::mul(sums[i][v], s), out));
          }
        }
      } else {
        const int block_pairs = w.scale_group > 0 ? w.scale_group / 2 : pairs;
        Float acc[M][kVecs];
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
    }
  };
};

// Few rows: codes decoded in the tiles' registers. row_of(i) -> P::Row.
template <class P, int MaxM, int NV, class RowOf>
void gemm_fp8_in_registers(RowOf row_of, int rows, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<Fp8Tiles<P, true>::template Tile, MaxM, NV, typename P::Row>(row_of, rows, w, y, y_stride);
}

// Many rows: kGroups groups x one scale block decoded to the stack (16 KiB) once for all the rows.
template <class P, int MaxM, int NV, Fp8DecodeFn Decode, class RowOf>
void gemm_fp8_decoded(RowOf row_of, int rows, const PackedGroups& w, float* y, size_t y_stride) {
  constexpr int kGroups = 4;
  alignas(64) bf16_t decoded[kGroups * kGroupRows * kFp8Block];
  const int block = w.scale_group > 0 ? w.scale_group : kFp8Block;
  const int k_even = round_up(w.k, 2);
  for (int g0 = 0; g0 < w.groups; g0 += kGroups) {
    const int groups = std::min(kGroups, w.groups - g0);
    for (int k0 = 0; k0 < k_even; k0 += block) {
      const int inputs = std::min(block, k_even - k0);  // even
      const size_t block_bytes = size_t(inputs) * kGroupRows;  // one group's codes of the block
      for (int g = 0; g < groups; ++g)
        Decode(w.values + size_t(g0 + g) * w.group_bytes + size_t(k0) * kGroupRows, decoded + g * block_bytes,
               block_bytes);
      const int scale_index = w.scale_group > 0 ? k0 / w.scale_group : 0;
      const PackedGroups d{reinterpret_cast<const uint8_t*>(decoded),
                           w.scales + size_t(g0) * w.group_scale_bytes + scale_index * kGroupRows * sizeof(float),
                           block_bytes * sizeof(bf16_t), w.group_scale_bytes, inputs, groups};
      const auto rows_from_k0 = [&](int i) { return row_of(i) + k0; };
      float* y_groups = y + g0 * kGroupRows;
      if (k0 == 0)
        gemm_tiled<Fp8Tiles<P, false>::template Tile, MaxM, NV, typename P::Row>(rows_from_k0, rows, d, y_groups,
                                                                                  y_stride);
      else
        gemm_tiled<Fp8Tiles<P, false, true>::template Tile, MaxM, NV, typename P::Row>(rows_from_k0, rows, d,
                                                                                        y_groups, y_stride);
    }
  }
}

// The FP8 GEMM of one path: in registers up to `Few` rows (Few x FewGroups tiles; more rows would
// decode each code again per tile), else through the stack (Many x ManyGroups tiles).
template <class P, int Few, int FewGroups, int Many, int ManyGroups, Fp8DecodeFn Decode, class RowOf>
void gemm_fp8(RowOf row_of, int rows, const PackedGroups& w, float* y, size_t y_stride) {
  if (rows <= Few)
    gemm_fp8_in_registers<P, Few, FewGroups>(row_of, rows, w, y, y_stride);
  else
    gemm_fp8_decoded<P, Many, ManyGroups, Decode>(row_of, rows, w, y, y_stride);
}

KT_NAMESPACE_END
