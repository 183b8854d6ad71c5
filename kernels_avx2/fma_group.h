// What the AVX2 BF16 and FP8 GEMMs share (gemm_bf16.cpp, gemm_fp8.cpp): the fp32 FMA step of one
// group's 16 rows on one activation row, and the tile size both use for calls of several rows.
#pragma once

#include "vec.h"

KT_NAMESPACE_BEGIN
namespace avx2 {

// Each accumulator takes two dependent FMAs per input pair, so 8 of them (FMA latency 4 x 2 ports)
// leave the FMA ports no slack; 5 rows x 1 group = 10 accumulators do (measured on one core: 4x1
// tiles 62-64 GFLOP/s, 5x1 70-75, of 95), and with one group's four weight vectors and a broadcast
// activation they fill the 16 ymm registers.
constexpr int kFmaRows = 5, kFmaGroups = 1;

// One group's 16 rows: two ymm of even and odd weights, two accumulators per activation row.
struct GroupPair {
  __m256 even[2], odd[2];
};

// acc0 += x[0] * w.even[0] + x[1] * w.odd[0], acc1 likewise with [1], in one asm block: with
// intrinsics GCC 12 hoists the broadcasts of all rows, runs out of registers and spills accumulators.
inline void fma_group(__m256& acc0_ref, __m256& acc1_ref, const float* x, const GroupPair& w) {
  __m256 acc0 = acc0_ref, acc1 = acc1_ref, broadcast;
  asm("vbroadcastss %[x0], %[b]\n\t"
      "vfmadd231ps %[e0], %[b], %[acc0]\n\t"
      "vfmadd231ps %[e1], %[b], %[acc1]\n\t"
      "vbroadcastss %[x1], %[b]\n\t"
      "vfmadd231ps %[o0], %[b], %[acc0]\n\t"
      "vfmadd231ps %[o1], %[b], %[acc1]"
      : [acc0] "+x"(acc0), [acc1] "+x"(acc1), [b] "=&x"(broadcast)
      : [x0] "m"(x[0]), [x1] "m"(x[1]), [e0] "x"(w.even[0]), [e1] "x"(w.even[1]), [o0] "x"(w.odd[0]),
        [o1] "x"(w.odd[1]));
  acc0_ref = acc0;
  acc1_ref = acc1;
}

}  // namespace avx2
KT_NAMESPACE_END
