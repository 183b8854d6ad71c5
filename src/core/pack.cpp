// Packing of BF16 weights into the group layout described in kernels.h (shared by every build).
#include <cstring>

#include "kernels.h"

KT_NAMESPACE_BEGIN

void pack_bf16(const bf16_t* weights, int rows, int k, bf16_t* packed) {
  const int k_pairs = packed_k(k) / 2;
  const size_t group_elems = packed_group_elems(k);
  for (int g = 0; g < packed_groups(rows); ++g) {
    bf16_t* group = packed + g * group_elems;
    std::memset(group, 0, group_elems * sizeof(bf16_t));
    for (int r = 0; r < kGroupRows && g * kGroupRows + r < rows; ++r) {
      const bf16_t* row = weights + size_t(g * kGroupRows + r) * k;
      for (int p = 0; p < k_pairs; ++p) {
        group[(size_t(p) * kGroupRows + r) * 2] = row[2 * p];
        if (2 * p + 1 < k) group[(size_t(p) * kGroupRows + r) * 2 + 1] = row[2 * p + 1];
      }
    }
  }
}

KT_NAMESPACE_END
