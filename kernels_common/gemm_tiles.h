// ISA-neutral driver for register-tiled GEMM microkernels: walks a run of packed weight groups NV
// at a time and, for each, all activation rows MaxM at a time, so each weight line is reused for
// MaxM rows while it is hot. The microkernel is Tile<M, NV>::run for the actual M, NV.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "bf16.h"
#include "kernels.h"

KT_NAMESPACE_BEGIN

// Unrolls the loop that follows completely: a tile's accumulator arrays then stay in registers.
#define KT_UNROLL _Pragma("GCC unroll 16")

// Every tile prefetches its weights this far ahead: it does enough work per byte that the hardware
// prefetcher alone leaves DRAM idle between bursts (measured on this project's Xeon: MXFP4 decode
// 10-30 % faster, BF16 decode 10-25 %, avx2 BF16 prefill 13 %).
constexpr int kWeightPrefetchBytes = 4096;

// Into L1 where later row blocks reread the lines (prefill: the multiply-adds wait on L1 misses);
// into L2 where one pass reads them once (decode): there 64 lines ahead per stream and up to eight
// streams per tile hold more misses than L1 can track, and the demand loads wait behind them
// (Zen 4, 2 threads, qwen3-30b: INT4 T = 8 9.0-10.0 -> 5.5-6.5 ms; avx2 BF16 prefill about 10 % slower
// with L2 prefetches). `line` is in group `group` of w; gemm_tiled sets where the prefetches go.
struct WeightPrefetch {
  ptrdiff_t distance;
  bool to_l1;
  // Volatile asm, not _mm_prefetch: GCC 12 deleted the tiles' prefetches (both kinds) when this
  // function chose between the two by a branch. The address goes in a register ("r"), never as a
  // memory operand ("m"): GCC then assumed the asm might read the tile's accumulator array and
  // stored every accumulator to the stack on each step (vdpbf16ps BF16 tiles of 6 x 4: 24 zmm
  // stores per 24 multiply-adds; 2.3x slower on Zen 4, whose stores are 256 bits wide).
  void operator()(const uint8_t* line) const {
    if (to_l1)
      asm volatile("prefetcht0 (%0)" : : "r"(line + distance));
    else
      asm volatile("prefetcht1 (%0)" : : "r"(line + distance));
  }
};

// The prefetch of `line` and of the lines just after it (a 4-bit tile's step: a few hundred bytes,
// one decision for them where one per line took 6 instructions of a Q4_K group's 223, avx2).
inline WeightPrefetch weight_prefetch(const PackedGroups& w, int group, const uint8_t* line) {
  if (w.prefetch_to_l1) return {kWeightPrefetchBytes, true};
  const size_t in_group = size_t(line - w.values) - size_t(group) * w.group_bytes;
  return {in_group < w.far_from ? ptrdiff_t(kWeightPrefetchBytes) : w.far_distance, false};
}

inline void prefetch_weights(const PackedGroups& w, int group, const uint8_t* line) {
  weight_prefetch(w, group, line)(line);
}

// The weights of one pass, read once (decode): 4 KiB ahead into L2, and from 4 KiB before the end
// of a group on into the start of the same group of `next`, the groups read after these (null:
// none known), so that no stream starts cold: a decode's pass reads only 12-32 KiB per stream
// (Xeon VM, qwen3-30b, 2 threads, T = 1: FP8 1.63-1.67 -> 1.52-1.58 ms, MXFP4 1.04-1.07 -> 0.91-0.95).
inline void prefetch_one_pass(PackedGroups& w, const uint8_t* next) {
  w.prefetch_to_l1 = false;
  w.far_from = w.group_bytes - std::min<size_t>(w.group_bytes, kWeightPrefetchBytes);
  w.far_distance = next == nullptr ? ptrdiff_t(kWeightPrefetchBytes)
                                   : next - w.values + kWeightPrefetchBytes - ptrdiff_t(w.group_bytes);
}

// Each line's place in other weights, `distance` bytes on, into L2.
inline void prefetch_elsewhere(PackedGroups& w, ptrdiff_t distance) {
  w.prefetch_to_l1 = false;
  w.far_from = 0;
  w.far_distance = distance;
}

// x_rows: M activation row handles (const bf16_t*, const float* where a kernel widens rows first,
// QuantizedRow where the kernel multiplies in integers); w: NV groups starting at w.values; y: M rows x NV * 16.
template <typename Row>
using TileFn = void (*)(const Row* x_rows, const PackedGroups& w, float* y, size_t y_stride);

template <template <int, int> class Tile, int MaxM, int NV, typename Row>
struct TileTable {
  template <size_t... I>
  static constexpr std::array<TileFn<Row>, sizeof...(I)> make(std::index_sequence<I...>) {
    return {{&Tile<int(I / NV) + 1, int(I % NV) + 1>::run...}};
  }
  static constexpr std::array<TileFn<Row>, MaxM * NV> table = make(std::make_index_sequence<MaxM * NV>{});
};

// row_of(i) -> Row: activation row i of m.
template <template <int, int> class Tile, int MaxM, int NV, typename Row, typename RowOf>
void gemm_tiled(RowOf row_of, int m, const PackedGroups& w, float* y, size_t y_stride) {
  for (int g0 = 0; g0 < w.groups; g0 += NV) {
    const int nv = std::min(NV, w.groups - g0);
    PackedGroups block = w;
    block.values += g0 * w.group_bytes;
    block.scales += g0 * w.group_scale_bytes;
    if (w.zeros != nullptr) block.zeros += g0 * w.group_zero_bytes;
    block.groups = nv;
    // Row blocks of near-equal size (32 rows with MaxM = 5: 5,5,5,5,4,4,4, not 5 x 6 + 2): a tile of
    // few rows has too few accumulators to keep the multiply-add ports busy.
    const int blocks = ceil_div(m, MaxM);
    for (int b = 0, i0 = 0; b < blocks; ++b) {
      const int mm = ceil_div(m - i0, blocks - b);
      // A single pass (decode) reads these weights once. Of several, the first streams them from
      // DRAM; the second, from cache, pulls the same lines of the next call's weights into L2
      // instead, so that its first pass need not wait on DRAM.
      if (blocks == 1)
        prefetch_one_pass(block, g0 + NV < w.groups ? block.values + size_t(NV) * w.group_bytes : w.next_values);
      else if (b == 1 && w.next_values != nullptr)
        prefetch_elsewhere(block, w.next_values - w.values);
      else
        block.prefetch_to_l1 = true;
      Row rows[MaxM];
      for (int i = 0; i < mm; ++i) rows[i] = row_of(i0 + i);
      TileTable<Tile, MaxM, NV, Row>::table[(mm - 1) * NV + (nv - 1)](rows, block,
                                                                      y + size_t(i0) * y_stride + g0 * kGroupRows,
                                                                      y_stride);
      i0 += mm;
    }
  }
}

template <template <int, int> class Tile, int MaxM, int NV>
void gemm_tiled(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<Tile, MaxM, NV, const bf16_t*>([&](int i) { return x.row(i); }, x.rows, w, y, y_stride);
}

// The fp32 FMA tiles' activation rows: x's rows widened to fp32 in x.scratch, round_up(k, 2) floats
// each, once per call (the compiler vectorizes the loop). The tiles then broadcast each activation
// from memory instead of widening it in every tile (on avx512 a third of their vector instructions).
// WidenedRows(i) is row i's handle.
struct WidenedRows {
  const float* base;
  size_t row_elems;
  const float* operator()(int i) const { return base + size_t(i) * row_elems; }
};
inline WidenedRows widen_rows(const Activations& x, int k) {
  float* widened = reinterpret_cast<float*>(x.scratch);
  const int row_elems = round_up(k, 2);
  for (int i = 0; i < x.rows; ++i) {
    const bf16_t* src = x.row(i);
    float* dst = widened + size_t(i) * row_elems;
    for (int c = 0; c < row_elems; ++c) dst[c] = bf16_to_float(src[c]);
  }
  return {widened, size_t(row_elems)};
}

// The integer formats' tiles take QuantizedRow handles.
template <template <int, int> class Tile, int MaxM, int NV>
void gemm_tiled_quantized(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_tiled<Tile, MaxM, NV, QuantizedRow>([&](int i) { return x.quantized_row(i); }, x.rows, w, y, y_stride);
}

// A token's quantized rows, as the 4-bit tiles take them: the row and, with P = 2, its residual.
template <int P>
struct QuantizedParts {
  QuantizedRow part[P];
  // Per scale group, where the last part's integer sums start (IntTiles::gemm_tokens).
  const int32_t* group_starts = nullptr;
};

// Where a GEMM took each row and its residual together (x.quantized.parts == 2) and wrote the
// token's whole result into the row's output: zeros into the residual's.
inline void zero_residual_outputs(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  for (int i = 1; x.quantized.parts == 2 && i < x.rows; i += 2)
    std::memset(y + size_t(i) * y_stride, 0, size_t(w.groups) * kGroupRows * sizeof(float));
}

// The sum of a quantized row's values over inputs [first, first + count), both multiples of 16.
inline int32_t quantized_sum(const QuantizedRow& row, int first, int count) {
  return row.running_sums[(first + count) / kSumBlock] - row.running_sums[first / kSumBlock];
}

// The two bf16 activations x[2p], x[2p+1] as one 32-bit lane (low half = even input).
inline int32_t load_bf16_pair(const bf16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

// Four int8 activations x[4j..4j+3] as one 32-bit lane.
inline int32_t load_int8_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof(quad));
  return quad;
}

// Masks the low nibbles of an INT4 or MXFP4 line (see kernels.h).
constexpr int32_t kLowNibbles = 0x0F0F0F0F;

// E8M0 scale 0 means 2^-127, an fp32 denormal; every other byte s maps to the bits s << 23.
constexpr int32_t kE8M0ZeroBits = 0x00400000;

KT_NAMESPACE_END
