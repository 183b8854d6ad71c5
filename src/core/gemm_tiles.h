// ISA-neutral driver for register-tiled GEMM microkernels: walks a block of `groups` packed weight
// groups NV at a time and, for each, all activation rows MaxM at a time, so each weight line is
// reused for MaxM rows while it is hot. The microkernel is Tile<M, NV>::run for the actual M, NV.
#pragma once

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "kernels.h"

KT_NAMESPACE_BEGIN

using TileFn = void (*)(const bf16_t* const* x_rows, const bf16_t* packed, size_t group_elems,
                        int k_pairs, float* y, size_t y_stride);

template <template <int, int> class Tile, int MaxM, int NV>
struct TileTable {
  template <size_t... I>
  static constexpr std::array<TileFn, sizeof...(I)> make(std::index_sequence<I...>) {
    return {{&Tile<int(I / NV) + 1, int(I % NV) + 1>::run...}};
  }
  static constexpr std::array<TileFn, MaxM * NV> table = make(std::make_index_sequence<MaxM * NV>{});
};

template <template <int, int> class Tile, int MaxM, int NV>
void gemm_tiled(const bf16_t* x, size_t x_stride, const int32_t* row_ids, int m, const bf16_t* packed,
                int k, int groups, float* y, size_t y_stride) {
  const size_t group_elems = packed_group_elems(k);
  const int k_pairs = packed_k(k) / 2;
  for (int g0 = 0; g0 < groups; g0 += NV) {
    const int nv = std::min(NV, groups - g0);
    for (int i0 = 0; i0 < m; i0 += MaxM) {
      const int mm = std::min(MaxM, m - i0);
      const bf16_t* rows[MaxM];
      for (int i = 0; i < mm; ++i) rows[i] = x + size_t(row_ids ? row_ids[i0 + i] : i0 + i) * x_stride;
      TileTable<Tile, MaxM, NV>::table[(mm - 1) * NV + (nv - 1)](
          rows, packed + g0 * group_elems, group_elems, k_pairs, y + size_t(i0) * y_stride + g0 * kGroupRows,
          y_stride);
    }
  }
}

// The two bf16 activations x[2p], x[2p+1] as one 32-bit lane (low half = even input).
inline int32_t load_bf16_pair(const bf16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

KT_NAMESPACE_END
