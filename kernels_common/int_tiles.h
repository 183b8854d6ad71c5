// INT8 and 4-bit (INT4, MXFP4) register tiles on int8 activations, written once for every ISA: `V`
// is the vector width (AVX512: one zmm per 16-row group; AVX2: two ymm), `Dot` the u8 x s8 dot
// product of that ISA (vpdpbusd, or its emulation by vpmaddwd / vpmaddubsw) and `FourBit` what a
// 4-bit format adds (Int4Format, Mxfp4Format below). Layouts and weight offsets: kernels.h.
//
// V provides: Int, Float, kLanes, load(const uint8_t*), load_ps, loadu_ps, set1, set1_ps, and_, or_, srli_epi32,
// slli_epi32, add_epi8, add_epi32, sub_epi32, mullo_epi32, to_float, fmadd, mul, add_ps, storeu_ps, lookup16(table,
// indices) (a byte per index < 16), e8m0_to_float(kLanes bytes) (2^(s - 127); s = 0 gives the
// fp32 denormal 2^-127), e4m3_to_float(kLanes bytes) (unsigned E4M3 codes, exactly),
// half_to_float(kLanes fp16, unaligned), six_bits_to_float(bytes, bias) (kLanes 6-bit fields, lane
// i at bits 6i..6i+5, minus bias; reads up to 16 bytes) and four_bits_to_float(bytes) (kLanes 4-bit
// fields, lane i at bits 4i..4i+3).
// Dot provides: Weights weights(V::Int line), Act activation(const int8_t* values, int j) (the
// activations 4j..4j+3 of a row), V::Int dot(V::Int acc, const Weights&, const Act&) = acc + per
// 32-bit lane sum of 4 u8 x s8 (or, MaddwdDot, u8 x s16), kQuadsPerSum (how many quads an int32
// sum of the INT8 tile may take without overflowing); for the 4-bit tiles also a Partial where the
// products of lines_per_partial(largest weight) lines gather: begin(sum), add2(partial, w1, a1, w2,
// a2) (the products of one line's two halves) and end(sum, partial) (the sum with the partial
// added). Most Dots add straight into the int32 sum (SumsInPlace); vpmaddubsw's int16 lanes hold
// several lines before one vpmaddwd widens them.
#pragma once

#include "gemm_tiles.h"

KT_NAMESPACE_BEGIN

// A Dot's 4-bit products added straight into the int32 sums: the partial is the sum itself.
template <class Dot, class Int>
struct SumsInPlace {
  using Partial = Int;
  static constexpr bool kPartialsFromZero = false;  // a partial starts at its sum
  static constexpr int lines_per_partial(int) { return 1; }
  static Int begin(Int sum) { return sum; }
  static Int add2(Int sum, const auto& w1, const auto& a1, const auto& w2, const auto& a2) {
    return Dot::dot(Dot::dot(sum, w1, a1), w2, a2);
  }
  static Int end(Int, Int partial) { return partial; }
};

// INT4: the nibbles are q + 8 already; one float scale per G inputs per row. A 4-bit format gives:
// kOffset (added to each value to make it unsigned), kMaxValue (the largest such u8 value),
// low_values(bytes, low_nibbles) (the u8 values + kOffset of the bytes' low nibbles), kValueScale
// (what one unit of those values is worth), inputs_per_scale(w), scale(group_scales, s, first_row)
// (the kLanes rows' scales of group s).
// kByteValues: values of a byte each (GGUF), an octet in two INT8-layout lines instead of one
// line's nibbles; kIndexed: the nibbles index the weights' own 16 levels (w.levels: GGUF); kMins: a
// min per scale group, added times the activations' sum (GGUF); kStepLines: the 8-input lines of a
// tile step of value planes (GGUF, kernels.h: a unit, or half a unit of crumbs), 0 without planes;
// kShifted: the values are q - lowest (w.value_offset: lowest + 128), each scale group's sum started
// at lowest * sum(x) (GGUF).
template <class V>
struct Int4Format {
  static constexpr int kOffset = kInt4Offset, kMaxValue = 15;
  static constexpr float kValueScale = 1.0f;
  static constexpr bool kByteValues = false, kIndexed = false, kMins = false, kShifted = false;
  static constexpr int kStepLines = 0;
  static typename V::Int low_values(typename V::Int bytes, typename V::Int low_nibbles) {
    return V::and_(bytes, low_nibbles);
  }
  static int inputs_per_scale(const PackedGroups& w) { return w.scale_group; }
  static typename V::Float scale(const PackedGroups&, const uint8_t* group_scales, int s, int first_row) {
    return V::load_ps(reinterpret_cast<const float*>(group_scales) + s * kGroupRows + first_row);
  }
};

// MXFP4: twice an E2M1 value is an integer in -12..12, so one byte lookup turns a code into the u8
// 2v + 12, and each 32-input block's sum is scaled by its E8M0 power of two (the halving is applied
// once, to the result: exact). The activations arrive in the packed layout's octet order
// (kernels.h), so the words are read as they are.
template <class V>
struct Mxfp4Format {
  static constexpr int kOffset = 12, kMaxValue = 24;
  static constexpr float kValueScale = 0.5f;
  static constexpr bool kByteValues = false, kIndexed = false, kMins = false, kShifted = false;
  static constexpr int kStepLines = 0;
  // E2M1 code -> 2 x value + 12 (codes 8..15 are the negatives of 0..7).
  alignas(16) static constexpr int8_t kValues[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  static typename V::Int low_values(typename V::Int bytes, typename V::Int low_nibbles) {
    return V::lookup16(kValues, V::and_(bytes, low_nibbles));
  }
  static int inputs_per_scale(const PackedGroups&) { return kMxfp4Block; }
  static typename V::Float scale(const PackedGroups&, const uint8_t* group_scales, int block, int first_row) {
    return V::e8m0_to_float(group_scales + block * kGroupRows + first_row);
  }
};

// GGUF: int8 values stored as q + 128 in the INT8 layout (a line is a quad, two lines an octet), a
// scale and a min per G = 16 or 32 inputs, fp32, fp16 or factored (kernels.h). Never on vpmaddubsw:
// byte weights would saturate its int16 sums (GgufNibbleFormat's and GgufPlanarFormat's may take it).
template <class V>
struct GgufFormat {
  static constexpr int kOffset = kInt8Offset, kMaxValue = 255;
  static constexpr float kValueScale = 1.0f;
  static constexpr bool kByteValues = true, kIndexed = false, kMins = true, kShifted = false;
  static constexpr int kStepLines = 0;
  static int inputs_per_scale(const PackedGroups& w) { return w.scale_group; }
  // The scales and the mins (0 without: the tiles multiply them by sum(x), the group's start
  // -128 * sum(x) times -1/128) of scale groups s0 .. s0 + n, kLanes rows from first_row, into
  // scales[i] and mins[i]. A loop per layout, its branches taken once per block: taken per scale
  // group and row vector, with their index arithmetic, they were 37 % of a Q4_K GEMM's instructions
  // at one token (avx2); the factors decoded per scale group and signed indices another 15 % (the
  // GEMMs of a Q4_K layer, one token: 79.6 -> 67.7 M instructions, bench/one_layer.py). Tiles compiled
  // apart per layout ran a factored prefill 5 % slower (T = 512, avx512, one process, interleaved).
  static void block(const PackedGroups& w, const uint8_t* group_scales, int s0, int n, int first_row,
                    typename V::Float* scales, typename V::Float* mins) {
    using Float = typename V::Float;
    // Copies: the stores of Float (may_alias) would reload w's fields.
    const bool has_mins = w.mins;
    const int bias = w.multiple_bias;
    // Entry e of group s0 + i at first + i * stride (values), the mins' one entry_step on.
    // Unsigned: a signed index divided by 8 (the 6-bit entries) took a sign fix-up each.
    const unsigned first = gguf_entry_index(s0, 0, has_mins) + first_row, stride = gguf_entry_index(1, 0, has_mins);
    const unsigned entry_step = kGroupRows;
    const auto each = [&](auto decode) {  // decode(index of the entry's first row, entry)
      unsigned at = first;
      for (int i = 0; i < n; ++i, at += stride) {
        scales[i] = decode(at, 0);
        mins[i] = has_mins ? decode(at + entry_step, 1) : V::set1_ps(0.0f);
      }
    };
    if (w.e4m3_scales)  // no mins: a byte per row and scale group
      return each([&](unsigned at, int) { return V::e4m3_to_float(group_scales + at); });
    if (!w.factored_scales) {
      if (w.half_scales) return each([&](unsigned at, int) { return V::half_to_float(group_scales + 2 * at); });
      return each([&](unsigned at, int) { return V::load_ps(reinterpret_cast<const float*>(group_scales) + at); });
    }
    // Factored: the n groups (at most 8 of 16 or 32 inputs from a multiple of 8) lie in one block of
    // kGgufBlockInputs inputs, one factor each for the scales and the mins, decoded once.
    const uint8_t* multiples = group_scales + w.multiples_at;
    const uint8_t* factors = group_scales + w.factors_at;
    const unsigned f = gguf_factor_index(s0, 0, w.scale_group, has_mins) + first_row;
    const auto factor = [&](unsigned at) {
      return w.half_factors ? V::half_to_float(factors + 2 * at)
                            : V::loadu_ps(reinterpret_cast<const float*>(factors) + at);
    };
    const Float factor_of[2] = {factor(f), has_mins ? factor(f + entry_step) : V::set1_ps(0.0f)};
    if (w.multiple_bits == 6)
      return each(
          [&](unsigned at, int e) { return V::mul(V::six_bits_to_float(multiples + at * 6 / 8, bias), factor_of[e]); });
    if (w.multiple_bits == 4)  // no bias (kernels.h)
      return each([&](unsigned at, int e) { return V::mul(V::four_bits_to_float(multiples + at / 2), factor_of[e]); });
    each([&](unsigned at, int e) {
      return V::mul(V::int8_to_float(reinterpret_cast<const int8_t*>(multiples) + at), factor_of[e]);
    });
  }
};

// GGUF held as 4-bit indices into 16 levels (+ 128): the INT4 layout, each nibble looked up in the
// projection's levels (w.levels) by one byte shuffle.
template <class V>
struct GgufIndexedFormat : GgufFormat<V> {
  static constexpr bool kByteValues = false, kIndexed = true;
};

// GGUF held as 4-bit indices into the levels lowest .. lowest + 15 in order (Q4_K's, Q4_1's 0..15,
// Q4_0's -8..7): the nibbles are v = q - lowest themselves (for_gguf_values sets w.value_offset), so
// the tiles mask them as INT4's, with no lookup, and vpmaddubsw multiplies them exactly: 4 lines
// in its int16 lanes, as INT4 (avx2, Q4_K, one token: 35.2 -> 30.2 M instructions a layer,
// bench/one_layer.py).
template <class V>
struct GgufNibbleFormat : GgufFormat<V> {
  static constexpr int kMaxValue = 15;
  static constexpr bool kByteValues = false, kShifted = true;
  static typename V::Int low_values(typename V::Int bytes, typename V::Int low_nibbles) {
    return V::and_(bytes, low_nibbles);
  }
};

// Where a step of value planes lies in its group: its first low line and its unit's plane line, and
// the shift that brings the step's high bits to the plane's first quads (the second half of a crumb
// unit: by its 4 quads).
struct PlaneStep {
  int low = 0, plane = 0, plane_shift = 0;
};

// GGUF held as value planes of kBits (2, 3, 5 or 6) bits (kernels.h): a tile step's quads from its
// low lines (nibbles or crumbs), each or-ed with its high bits from the unit's plane line. The tile
// multiplies the values v = q - lowest as they are and starts each scale group's sum at
// lowest * sum(x) (FourBitParts), where adding w.value_offset to every byte took two more operations
// per line (avx2, Q6_K, T = 1: 2 % of the GEMM's instructions).
template <class V, int kBits>
struct GgufPlanarFormat : GgufFormat<V> {
  using Int = typename V::Int;
  static constexpr bool kByteValues = false, kShifted = true;
  static constexpr int kLowBits = plane_low_bits(kBits), kHighBits = plane_high_bits(kBits);
  static constexpr int kMaxValue = (1 << kBits) - 1, kQuadsPerLine = 8 / kLowBits;
  // A step: a unit of nibbles; half a unit of crumbs (16 inputs: one crumb line, Q3_K's scale group).
  static constexpr int kStepLines = kLowBits == 4 ? plane_lines(kBits) : 2;
  static constexpr int kStepsPerUnit = unit_inputs(kBits) / (8 * kStepLines);
  static PlaneStep step_at(int c) {
    const unsigned step = unsigned(c) / kStepLines, half = step % kStepsPerUnit;  // c >= 0
    const int unit = int(step / kStepsPerUnit) * unit_lines(kBits);
    return {unit + int(half) * kStepLines * kLowBits / 4, unit + plane_lines(kBits),
            int(half) * kHighBits * 2 * kStepLines};
  }
  // The low line of a step that holds quad q (from the step's first).
  static constexpr int low_line(int q) { return q / kQuadsPerLine; }
  // The u8 values v of quad q of a step: `line` its low line, `plane` the step's plane (shifted:
  // step_at). q is a constant once the tile's line loop is unrolled: immediate shifts.
  static Int values(Int line, Int plane, int q) {
    const int low_shift = kLowBits * (q % kQuadsPerLine);
    const Int low = V::and_(low_shift > 0 ? V::srli_epi32(line, low_shift) : line,
                            V::set1(((1 << kLowBits) - 1) * 0x01010101));
    if constexpr (kHighBits == 0) {
      return low;
    } else {
      const int at = kHighBits * q;  // the high bits' place in each plane byte, wanted at kLowBits
      const Int high = at <= kLowBits ? V::slli_epi32(plane, kLowBits - at) : V::srli_epi32(plane, at - kLowBits);
      return V::or_(low, V::and_(high, V::set1((((1 << kHighBits) - 1) << kLowBits) * 0x01010101)));
    }
  }
};

// The INT8 tile on int8 activations: one int32 sum takes a whole row (k <= kInt8MaxK, kernels.h).
constexpr int kInt8ActivationQuadsPerSum = kInt8MaxK / 4;

// The u8 x s8 dot products of ISAs without vpdpbusd. V also provides srli_epi16, madd_epi16,
// maddubs_epi16 and add_epi16.
//
// 4-bit weights (INT4: 0..15, MXFP4: 0..24) on int8 rows: a line's two vpmaddubsw add at most
// 4 x 128 x the largest weight to an int16 lane, so the lanes hold the products of 4 INT4 lines
// before vpmaddwd by 1 widens them: 4.25 vector operations per line and row instead of 5 (one
// core, in cache, one token: avx2 22.4 -> 25.9 GB/s, avx512 without VNNI 33.4 -> 37). MXFP4's lanes
// would hold 2 lines, but its avx2 tile then outgrew the 16 ymm registers and ran about 5 % slower:
// it widens every line.
template <class V>
struct MaddubsDot {
  using Int = typename V::Int;
  using Weights = Int;
  using Act = Int;
  using Partial = Int;
  static constexpr bool kPartialsFromZero = true;  // begin() ignores the sum
  static Weights weights(Int line) { return line; }
  static Act activation(const int8_t* values, int j) { return V::set1(load_int8_quad(values + 4 * j)); }
  static constexpr int lines_per_partial(int max_weight) { return 4 * 4 * 128 * max_weight <= INT16_MAX ? 4 : 1; }
  // Whether one line's 4 products (two vpmaddubsw added) fit an int16 lane: weights up to 63.
  static constexpr bool takes(int max_weight) { return 4 * 128 * max_weight <= INT16_MAX; }
  static Partial begin(Int) { return V::set1(0); }
  static Partial add2(Partial partial, Weights w1, Act a1, Weights w2, Act a2) {
    return V::add_epi16(partial, V::add_epi16(V::maddubs_epi16(w1, a1), V::maddubs_epi16(w2, a2)));
  }
  static Int end(Int sum, Partial partial) { return V::add_epi32(sum, V::madd_epi16(partial, V::set1(0x00010001))); }
};

// Any u8 weight on int16 activations (WidenedTokens below): even and odd bytes zero-extended to 16
// bits, vpmaddwd with the matching activations: the exact quad sum without saturation.
template <class V>
struct MaddwdDot : SumsInPlace<MaddwdDot<V>, typename V::Int> {
  using Int = typename V::Int;
  // INT8 weights (|q| <= 128) x activations up to 32,639: a sum of 512 inputs stays below 2^31.
  static constexpr int kQuadsPerSum = 128;
  struct Weights {
    Int even, odd;
  };
  using Act = Weights;
  static Weights weights(Int line) { return {V::and_(line, V::set1(0x00FF00FF)), V::srli_epi16(line, 8)}; }
  // Quad j of a widened row: int16 {x[4j], x[4j+2]}, {x[4j+1], x[4j+3]}, each pair broadcast.
  static Act activation(const int8_t* values, int j) {
    return {V::set1(load_int8_quad(values + 8 * j)), V::set1(load_int8_quad(values + 8 * j + 4))};
  }
  static Int dot(Int acc, const Weights& w, const Act& a) {
    return V::add_epi32(acc, V::add_epi32(V::madd_epi16(w.even, a.even), V::madd_epi16(w.odd, a.odd)));
  }
};

// x's tokens as MaddwdDot reads them, widened into x.scratch once per GEMM call: a token is a
// quantized row, or (parts = 2) a row q and its residual r at 1/256 of its scale, taken as the one
// int16 row 256 q + r (at most 32,639): one vpmaddwd then multiplies both, where the int8 rows took
// two multiplies each. tokens(t) is token t's handle (values: the widened row).
struct WidenedTokens {
  const Activations& x;
  const int16_t* values;
  int32_t* running_sums;  // parts = 2: 256 x the row's + the residual's; x.scratch is free after them
  size_t row_elems, sums;  // per token
  int count;
  QuantizedRow operator()(int t) const {
    const int parts = x.quantized.parts;
    const QuantizedRow last = x.quantized_row(parts * t + parts - 1);  // the residual carries the scale
    return {reinterpret_cast<const int8_t*>(values + t * row_elems),
            parts == 1 ? last.running_sums : running_sums + t * sums, last.scale};
  }
};

inline WidenedTokens widen_tokens(const Activations& x, int k) {
  const int parts = x.quantized.parts, tokens = x.rows / parts;
  const size_t row_elems = round_up(k, 4), sums = round_up(k, kActivationBlock) / kSumBlock + 1;
  int16_t* values = reinterpret_cast<int16_t*>(x.scratch);
  int32_t* running_sums = reinterpret_cast<int32_t*>(values + tokens * row_elems);  // fits kernel_scratch_bytes
  constexpr int kQuadOrder[4] = {0, 2, 1, 3};
  for (int t = 0; t < tokens; ++t) {
    const QuantizedRow row = x.quantized_row(parts * t);
    int16_t* dst = values + t * row_elems;
    if (parts == 1) {
      for (size_t c = 0; c < row_elems; c += 4)
        for (int e = 0; e < 4; ++e) dst[c + e] = row.values[c + kQuadOrder[e]];
      continue;
    }
    const QuantizedRow residual = x.quantized_row(parts * t + 1);
    for (size_t c = 0; c < row_elems; c += 4)
      for (int e = 0; e < 4; ++e)
        dst[c + e] = int16_t(256 * row.values[c + kQuadOrder[e]] + residual.values[c + kQuadOrder[e]]);
    for (size_t b = 0; b < sums; ++b) running_sums[t * sums + b] = 256 * row.running_sums[b] + residual.running_sums[b];
  }
  return {x, values, running_sums, row_elems, sums, tokens};
}

// Whether a row's and its residual's sums of a scale group, added as 256 * row + residual, fit in
// int32: inputs per scale x the largest weight x 127 x 257 (INT4: 4,096 inputs; GGUF's values up to
// 255: 258).
template <class FourBit>
bool pairs_fit(const PackedGroups& w) {
  return int64_t(FourBit::inputs_per_scale(w)) * FourBit::kMaxValue * 127 * 257 < (int64_t(1) << 31);
}

// The lines whose products a 4-bit tile gathers in one Dot::Partial: as many as its lanes hold,
// within a step of value planes, and one for crumbs (with two, GCC spilled ten ymm per step: avx2,
// Q2_K, one token, 3 layer calls: 85.1 -> 83.2 M instructions, bench/one_layer.py).
template <class Dot, class FourBit>
constexpr int partial_lines() {
  const int lines = Dot::lines_per_partial(FourBit::kMaxValue);
  if constexpr (FourBit::kStepLines > 0) return FourBit::kLowBits == 2 ? 1 : std::min(lines, FourBit::kStepLines);
  return lines;
}

// Every loop over a tile's rows is unrolled (KT_UNROLL): where GCC 12 kept one rolled, it held the
// accumulators in memory and stored each of them to the stack on every step of the inner loop
// (avx512, one core, 768 x 2048 in cache, 32 rows, exact activations: INT8 131 -> 360 GOP/s, INT4
// 187 -> 245).
template <class V, class Dot, class FourBit = Int4Format<V>>
struct IntTiles {
  using Int = typename V::Int;
  using Float = typename V::Float;
  static constexpr int kVecsPerGroup = kGroupRows / V::kLanes;
  static constexpr int kLineBytes = 64;

  // Vector v of a tile: group v / kVecsPerGroup, rows (v % kVecsPerGroup) * kLanes onwards.
  static const uint8_t* line(const PackedGroups& w, int v, int index) {
    return w.values + (v / kVecsPerGroup) * w.group_bytes + size_t(index) * kLineBytes +
           (v % kVecsPerGroup) * V::kLanes * 4;
  }
  // Prefetches line `index` of vector v's group once, from its first vector: the others (AVX2: the
  // second ymm) lie in the same 64 bytes (avx2, Q4_K, one token: 6 of a line's 40 instructions).
  static void prefetch_line(const PackedGroups& w, int v, int index) {
    if (v % kVecsPerGroup == 0) prefetch_weights(w, v / kVecsPerGroup, line(w, v, index));
  }
  static Float row_scales(const PackedGroups& w, int v) {
    return V::load_ps(reinterpret_cast<const float*>(w.scales + (v / kVecsPerGroup) * w.group_scale_bytes) +
                      (v % kVecsPerGroup) * V::kLanes);
  }
  static const uint8_t* zero_points(const PackedGroups& w, int v, int s) {
    return w.zeros + (v / kVecsPerGroup) * w.group_zero_bytes +
           (size_t(s) * kGroupRows + (v % kVecsPerGroup) * V::kLanes) * sizeof(int32_t);
  }
  static Float four_bit_scale(const PackedGroups& w, int v, int s) {
    return FourBit::scale(w, w.scales + (v / kVecsPerGroup) * w.group_scale_bytes, s, (v % kVecsPerGroup) * V::kLanes);
  }

  // y = x_scale * row_scale * (sum over k of (q + 128) * x - 128 * sum(x)), the sum taken in int32
  // over runs of Dot::kQuadsPerSum quads (int16 activations: 512 inputs) and added up in fp32.
  template <int M, int NV>
  struct Int8 {
    static constexpr int kVecs = NV * kVecsPerGroup;
    static void run(const QuantizedRow* x, const PackedGroups& w, float* y, size_t y_stride) {
      const int quads = round_up(w.k, 4) / 4;
      // Where one sum takes a whole row, one run with nothing to add to: a loop over runs cost the
      // vpdpbusd tile 5-10 % (one core, in cache).
      if constexpr (Dot::kQuadsPerSum >= kInt8MaxK / 4) {
        add_run<false>(x, w, y, y_stride, 0, quads);
      } else {
        for (int j0 = 0; j0 < quads; j0 += Dot::kQuadsPerSum) {
          const int j1 = std::min(quads, j0 + Dot::kQuadsPerSum);
          if (j0 == 0)
            add_run<false>(x, w, y, y_stride, j0, j1);
          else
            add_run<true>(x, w, y, y_stride, j0, j1);
        }
      }
    }
    // Quads [j0, j1) into y (kAdd: added to what y holds).
    template <bool kAdd>
    static void add_run(const QuantizedRow* x, const PackedGroups& w, float* y, size_t y_stride, int j0, int j1) {
      Int acc[M][kVecs];
      KT_UNROLL
      for (int i = 0; i < M; ++i)
        for (int v = 0; v < kVecs; ++v) acc[i][v] = V::set1(0);
      for (int j = j0; j < j1; ++j) {
        typename Dot::Weights wv[kVecs];
        for (int v = 0; v < kVecs; ++v) {
          prefetch_line(w, v, j);
          wv[v] = Dot::weights(V::load(line(w, v, j)));
        }
        KT_UNROLL
        for (int i = 0; i < M; ++i) {
          const typename Dot::Act a = Dot::activation(x[i].values, j);
          for (int v = 0; v < kVecs; ++v) acc[i][v] = Dot::dot(acc[i][v], wv[v], a);
        }
      }
      // kQuadsPerSum is a multiple of 8: every run but the last is whole activation blocks.
      const int inputs = (4 * j1 >= w.k ? round_up(w.k, kActivationBlock) : 4 * j1) - 4 * j0;
      KT_UNROLL
      for (int i = 0; i < M; ++i) {
        const Int offset = V::set1(kInt8Offset * quantized_sum(x[i], 4 * j0, inputs));
        const Float x_scale = V::set1_ps(x[i].scale);
        for (int v = 0; v < kVecs; ++v) {
          float* out = y + i * y_stride + v * V::kLanes;
          Float sum = V::mul(V::to_float(V::sub_epi32(acc[i][v], offset)), V::mul(row_scales(w, v), x_scale));
          if constexpr (kAdd) sum = V::add_ps(V::loadu_ps(out), sum);
          V::storeu_ps(out, sum);
        }
      }
    }
  };

  // Per scale group s: y += scale[s] * (sum over the group of (q + offset) * x - offset * sum(x));
  // then y *= x_scale. Line c holds inputs 8c..8c+7 of 16 rows as nibbles (kernels.h).
  // Each of the M tokens is P quantized rows (QuantizedParts): one, or (P = 2) a row and its residual
  // at 1/256 of its scale, whose sums of a scale group are added as 256 * row + residual before
  // they are converted: a token then takes one float accumulator, not two, and a tile of four
  // tokens (eight rows) fits the registers where six rows spilled one (callers check that the sums
  // fit in int32: pairs_fit). The AMX build's 4-bit kernel adds them the same way.
  template <int P>
  struct FourBitParts {
    template <int M, int NV>
    struct Tile {
      static constexpr int kVecs = NV * kVecsPerGroup;
      // Every 4-bit scale group is whole runs of 4 lines (32 inputs), or of value planes' steps
      // (a scale group holds whole steps: gguf.cpp), their partials added into the sums every
      // kLinesPerPartial lines.
      static constexpr int kLinesPerPartial = partial_lines<Dot, FourBit>();
      static constexpr int kLinesPerStep = FourBit::kStepLines > 0 ? FourBit::kStepLines : kLinesPerPartial;
      static_assert(4 % kLinesPerPartial == 0 && kLinesPerStep % kLinesPerPartial == 0);
      static constexpr int kScaleBlock = 8;  // GGUF's scale groups decoded at a time
      static void run(const QuantizedParts<P>* x, const PackedGroups& w, float* y, size_t y_stride) {
        // GGUF's scale groups of one step each (Q6_K's, Q3_K's and Q2_K's 16 inputs, Q5_K's 32; Q4_K's
        // nibbles, 32 inputs, on vpmaddubsw): the step loop known to run once (avx2, Q6_K, one token,
        // 3 layer calls: 107.6 -> 100.9 M instructions). Not INT4's: a second copy of its tile in the
        // GEMM made GCC compile its groups of 128 with 19 % more instructions.
        if constexpr (FourBit::kShifted)
          if (FourBit::inputs_per_scale(w) == 8 * kLinesPerStep) return steps<true>(x, w, y, y_stride);
        steps<false>(x, w, y, y_stride);
      }
      // Where token x's sums of scale group s start: minus the weight offset times sum(x) (gemm_tokens).
      // Values less the lowest (kShifted): the start -128 * sum(x) made lowest * sum(x) (exact: a
      // multiple of 128, and no larger; divided by a shift, where / took a sign fix-up).
      static int32_t group_start(const QuantizedParts<P>& x, const PackedGroups& w, int s) {
        static_assert(kInt8Offset == 1 << 7);
        return FourBit::kShifted ? (x.group_starts[s] >> 7) * (kInt8Offset - int(w.value_offset)) : x.group_starts[s];
      }
      // kOneStep: each scale group is one step.
      template <bool kOneStep>
      static void steps(const QuantizedParts<P>* x, const PackedGroups& w, float* y, size_t y_stride) {
        [[maybe_unused]] const Int low_nibbles = V::set1(kLowNibbles);
        const int inputs_per_scale = FourBit::inputs_per_scale(w), lines_per_scale = inputs_per_scale / 8;
        Float acc[M][kVecs];
        KT_UNROLL
        for (int i = 0; i < M; ++i)
          for (int v = 0; v < kVecs; ++v) acc[i][v] = V::set1_ps(0.0f);
        const int scale_groups = w.k / inputs_per_scale;
        [[maybe_unused]] Float block_scale[kVecs][kScaleBlock], block_min[kVecs][kScaleBlock];
        for (int s = 0; s < scale_groups; ++s) {
          // This scale group's integer sums, started at minus the weight offset times sum(x).
          Int zeros[kVecs];  // INT4 zero points of this scale group (w.zeros: kernels.h)
          if (w.zeros != nullptr)
            for (int v = 0; v < kVecs; ++v) zeros[v] = V::load(zero_points(w, v, s));
          // The last part's sums start where the token's group_starts say (gemm_tokens), with
          // P = 2 the row's at 0 (a zero idiom): one broadcast from memory per token.
          const auto start_of = [&](int p, int v, Int start) {  // part p's start, from the token's
            if (P == 2 && p == 0) return V::set1(0);
            return w.zeros != nullptr ? V::mullo_epi32(zeros[v], start) : start;
          };
          // Late starts (a group of one step, partials from zero): each sum starts with its group's
          // first widened partial, so it holds no register through the lines before it (avx2, Q4_K,
          // one token: four sums kept on the stack through every group's lines).
          constexpr bool kLateStart = kOneStep && Dot::kPartialsFromZero;
          Int part[M][P][kVecs];
          if constexpr (!kLateStart) {
            // Written out, not by start_of: through it GCC 12 compiled INT4's tile with 17 % more
            // instructions (avx2, one token, groups of 128: 36.9 -> 43.3 M, bench/one_layer.py).
            KT_UNROLL
            for (int i = 0; i < M; ++i) {
              const Int start = V::set1(group_start(x[i], w, s));
              for (int v = 0; v < kVecs; ++v) {
                if constexpr (P == 2) part[i][0][v] = V::set1(0);
                part[i][P - 1][v] = w.zeros != nullptr ? V::mullo_epi32(zeros[v], start) : start;
              }
            }
          }
          // A do-while (a scale group holds at least one line): GCC 12 keeps the sums of a loop that
          // may run zero times in memory, stored and reloaded around it (avx512, one core, in cache:
          // INT4 +6 %).
          int c = s * lines_per_scale;
          do {
            typename Dot::Partial partial[M][P][kVecs];
            KT_UNROLL
            for (int i = 0; i < M; ++i)
              for (int p = 0; p < P; ++p)
                for (int v = 0; v < kVecs; ++v) partial[i][p][v] = Dot::begin(kLateStart ? V::set1(0) : part[i][p][v]);
            // Value planes: the step's low lines and its unit's plane line.
            [[maybe_unused]] PlaneStep at;
            if constexpr (FourBit::kStepLines > 0) at = FourBit::step_at(c);
            // The step's lines lie together from its first: their prefetches go one way (weight_prefetch).
            const int first = FourBit::kStepLines > 0 ? at.low : FourBit::kByteValues ? 2 * c : c;
            WeightPrefetch ahead[kVecs] = {};
            for (int v = 0; v < kVecs; v += kVecsPerGroup)
              ahead[v] = weight_prefetch(w, v / kVecsPerGroup, line(w, v, first));
            const auto prefetch = [&](int v, int index) {
              if (v % kVecsPerGroup == 0) ahead[v](line(w, v, index));
            };
            [[maybe_unused]] Int plane[kVecs];
            if constexpr (FourBit::kStepLines > 0) {
              if constexpr (FourBit::kHighBits > 0)
                for (int v = 0; v < kVecs; ++v) {
                  prefetch(v, at.plane);
                  plane[v] = V::load(line(w, v, at.plane));
                  if constexpr (FourBit::kStepsPerUnit > 1) plane[v] = V::srli_epi32(plane[v], at.plane_shift);
                }
            }
            KT_UNROLL
            for (int l = 0; l < kLinesPerStep; ++l) {
              const int j = c + l;
              typename Dot::Weights low[kVecs], high[kVecs];  // inputs 8j..8j+3 and 8j+4..8j+7
              for (int v = 0; v < kVecs; ++v) {
                if constexpr (FourBit::kStepLines > 0) {
                  // Quads 2l and 2l + 1 of the step (a crumb line holds two lines' quads).
                  const int low_line = at.low + FourBit::low_line(2 * l);
                  if ((2 * l) % FourBit::kQuadsPerLine == 0) prefetch(v, low_line);
                  const Int raw = V::load(line(w, v, low_line));
                  const Int high_bits = FourBit::kHighBits > 0 ? plane[v] : raw;  // 2 bits: none
                  low[v] = Dot::weights(FourBit::values(raw, high_bits, 2 * l));
                  high[v] = Dot::weights(FourBit::values(raw, high_bits, 2 * l + 1));
                } else if constexpr (FourBit::kByteValues) {
                  prefetch(v, 2 * j);
                  prefetch(v, 2 * j + 1);
                  low[v] = Dot::weights(V::load(line(w, v, 2 * j)));
                  high[v] = Dot::weights(V::load(line(w, v, 2 * j + 1)));
                } else if constexpr (FourBit::kIndexed) {
                  prefetch(v, j);
                  const Int raw = V::load(line(w, v, j));
                  low[v] = Dot::weights(V::lookup16(w.levels, V::and_(raw, low_nibbles)));
                  high[v] = Dot::weights(V::lookup16(w.levels, V::and_(V::srli_epi32(raw, 4), low_nibbles)));
                } else {
                  prefetch(v, j);
                  const Int raw = V::load(line(w, v, j));
                  low[v] = Dot::weights(FourBit::low_values(raw, low_nibbles));
                  high[v] = Dot::weights(FourBit::low_values(V::srli_epi32(raw, 4), low_nibbles));
                }
              }
              KT_UNROLL
              for (int i = 0; i < M; ++i)
                for (int p = 0; p < P; ++p) {
                  const typename Dot::Act a_low = Dot::activation(x[i].part[p].values, 2 * j);
                  const typename Dot::Act a_high = Dot::activation(x[i].part[p].values, 2 * j + 1);
                  for (int v = 0; v < kVecs; ++v)
                    partial[i][p][v] = Dot::add2(partial[i][p][v], low[v], a_low, high[v], a_high);
                }
              if ((l + 1) % kLinesPerPartial == 0) {
                KT_UNROLL
                for (int i = 0; i < M; ++i) {
                  if (kLateStart && l + 1 == kLinesPerPartial) {  // the group's first partial
                    const Int start = V::set1(group_start(x[i], w, s));
                    for (int p = 0; p < P; ++p)
                      for (int v = 0; v < kVecs; ++v) {
                        part[i][p][v] = Dot::end(start_of(p, v, start), partial[i][p][v]);
                        partial[i][p][v] = Dot::begin(part[i][p][v]);
                      }
                    continue;
                  }
                  for (int p = 0; p < P; ++p)
                    for (int v = 0; v < kVecs; ++v) {
                      part[i][p][v] = Dot::end(part[i][p][v], partial[i][p][v]);
                      partial[i][p][v] = Dot::begin(part[i][p][v]);
                    }
                }
              }
            }
          } while (!kOneStep && (c += kLinesPerStep) < (s + 1) * lines_per_scale);
          // Decoded once for the M tokens: GCC did not share a decode (GGUF's 6-bit multiples, fp16
          // factors) between them (avx2, T = 8, Q4_K_M's GEMMs: 402 -> 216 M instructions). GGUF's
          // a block of scale groups at a time (GgufFormat::block).
          Float group_scale[kVecs], group_min[kVecs];
          if constexpr (FourBit::kMins) {
            if (s % kScaleBlock == 0)
              for (int v = 0; v < kVecs; ++v)
                FourBit::block(w, w.scales + (v / kVecsPerGroup) * w.group_scale_bytes, s,
                               std::min(kScaleBlock, scale_groups - s), (v % kVecsPerGroup) * V::kLanes,
                               block_scale[v], block_min[v]);
            for (int v = 0; v < kVecs; ++v) {
              group_scale[v] = block_scale[v][s % kScaleBlock];
              group_min[v] = block_min[v][s % kScaleBlock];
            }
          } else {
            for (int v = 0; v < kVecs; ++v) group_scale[v] = four_bit_scale(w, v, s);
          }
          KT_UNROLL
          for (int i = 0; i < M; ++i) {
            // The start, -128 * sum(x), is a multiple of 128 below 2^31: exact in fp32, and so is
            // sum(x), what GGUF's mins are multiplied by.
            const Float start = V::set1_ps(float(x[i].group_starts[s]) * (-1.0f / kInt8Offset));
            for (int v = 0; v < kVecs; ++v) {
              Int sum = part[i][0][v];
              if constexpr (P == 2) sum = V::add_epi32(V::slli_epi32(sum, 8), part[i][1][v]);
              acc[i][v] = V::fmadd(V::to_float(sum), group_scale[v], acc[i][v]);
              if constexpr (FourBit::kMins) acc[i][v] = V::fmadd(start, group_min[v], acc[i][v]);
            }
          }
        }
        KT_UNROLL
        for (int i = 0; i < M; ++i) {
          // The sums are in steps of the last part's scale (the residual's: the row's / 256).
          // w.scale_factor: GGUF's factor per matrix (E4M3 scales), else 1.
          const Float x_scale = V::set1_ps(x[i].part[P - 1].scale * FourBit::kValueScale * w.scale_factor);
          for (int v = 0; v < kVecs; ++v) V::storeu_ps(y + i * y_stride + v * V::kLanes, V::mul(acc[i][v], x_scale));
        }
      }
    };
  };
  template <int M, int NV>
  using FourBitTile = typename FourBitParts<1>::template Tile<M, NV>;
  template <int M, int NV>
  using PairedFourBitTile = typename FourBitParts<2>::template Tile<M, NV>;

  // A 4-bit GEMM on `tokens` tokens of P rows each (rows_of(t) -> QuantizedParts<P>): each token's
  // group starts are computed once per call into `starts` (tokens x scale groups int32): minus the
  // weight offset times the sum of the token's activations over the scale group, taken as
  // 256 * sum(row) + sum(residual) with P = 2, or, with zero points, minus that sum, which the tile
  // multiplies by each row's zero point. Computed in the tile, for every tile of tokens, they took
  // a fifth of its instructions (avx512, one core, in cache: INT4 exact 247 -> 288 GOP/s).
  template <template <int, int> class Tile, int MaxM, int NV, int P, class RowsOf>
  static void gemm_tokens(RowsOf rows_of, int tokens, const PackedGroups& w, float* y, size_t y_stride,
                          int32_t* starts) {
    const int groups = w.k / FourBit::inputs_per_scale(w);
    for (int t = 0; t < tokens; ++t) group_starts(rows_of(t), w, starts + t * groups);
    const auto token_of = [&](int t) {
      QuantizedParts<P> token = rows_of(t);
      token.group_starts = starts + t * groups;
      return token;
    };
    gemm_tiled<Tile, MaxM, NV, QuantizedParts<P>>(token_of, tokens, w, y, y_stride);
  }

  // One token's group starts (gemm_tokens), from its rows' running sums. A loop the compiler
  // vectorizes where a scale group is one activation block (MXFP4): the engine calls a GEMM per 64
  // outputs, each computing every token's starts again (scalar, they cost an MXFP4 prefill 4 %).
  template <int P>
  static void group_starts(const QuantizedParts<P>& token, const PackedGroups& w, int32_t* __restrict starts) {
    const int blocks = FourBit::inputs_per_scale(w) / kSumBlock, groups = w.k / FourBit::inputs_per_scale(w);
    const int32_t factor = w.zeros != nullptr ? -1 : -FourBit::kOffset;
    const int32_t* __restrict row = token.part[0].running_sums;
    const int32_t* __restrict residual = token.part[P - 1].running_sums;
    for (int s = 0; s < groups; ++s) {
      const int32_t row_sum = row[(s + 1) * blocks] - row[s * blocks];
      const int32_t sum = P == 2 ? 256 * row_sum + (residual[(s + 1) * blocks] - residual[s * blocks]) : row_sum;
      starts[s] = factor * sum;
    }
  }

  // Each of x's quantized rows on its own, tiles of MaxM rows x NV groups (x.scratch: the starts).
  template <int MaxM, int NV>
  static void gemm_four_bit_rows(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
    gemm_tokens<FourBitTile, MaxM, NV, 1>([&](int i) { return QuantizedParts<1>{{x.quantized_row(i)}}; }, x.rows, w,
                                          y, y_stride, reinterpret_cast<int32_t*>(x.scratch));
  }

  // A 4-bit GEMM: tiles of MaxPairs tokens x PairNV groups where x holds rows and residuals and
  // their sums fit, else of MaxM rows x NV groups. A token's whole result goes into its row's
  // output and zeros into its residual's: the engine adds the two as for every integer GEMM.
  template <int MaxM, int NV, int MaxPairs, int PairNV>
  static void gemm_four_bit(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
    if (x.quantized.parts != 2 || !pairs_fit<FourBit>(w)) {
      gemm_four_bit_rows<MaxM, NV>(x, w, y, y_stride);
      return;
    }
    const auto pair = [&](int t) {
      return QuantizedParts<2>{{x.quantized_row(2 * t), x.quantized_row(2 * t + 1)}};
    };
    gemm_tokens<PairedFourBitTile, MaxPairs, PairNV, 2>(pair, x.rows / 2, w, y, 2 * y_stride,
                                                         reinterpret_cast<int32_t*>(x.scratch));
    zero_residual_outputs(x, w, y, y_stride);
  }
};

// INT8 without vpdpbusd: tiles of MaxTokens widened tokens x NV groups (MaddwdDot).
template <class V, int MaxTokens, int NV>
void gemm_int8_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  const WidenedTokens tokens = widen_tokens(x, w.k);
  gemm_tiled<IntTiles<V, MaddwdDot<V>>::template Int8, MaxTokens, NV, QuantizedRow>(tokens, tokens.count, w, y,
                                                                                   x.quantized.parts * y_stride);
  zero_residual_outputs(x, w, y, y_stride);
}

// A 4-bit GEMM without vpdpbusd: tokens of a row and its residual as widened int16 rows (MaddwdDot:
// 4 multiplies and 4 adds per line, token and vector, where vpmaddubsw on the two int8 rows takes
// 8.5 operations for INT4, 10 for MXFP4), tiles of MaxTokens x TokenNV groups. One token (decode),
// int8 activations or sums that may not fit take MaddubsDot on the int8 rows, faster there: a row
// and its residual as one token (tiles of MaxRows / 2 tokens), else rows of their own (MaxRows), x
// NV groups.
template <class V, class FourBit, int MaxRows, int NV, int MaxTokens, int TokenNV>
void gemm_four_bit_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (x.quantized.parts == 2 && x.rows > 2 && pairs_fit<FourBit>(w)) {
    const WidenedTokens tokens = widen_tokens(x, w.k);
    int32_t* starts = tokens.running_sums + tokens.count * tokens.sums;
    IntTiles<V, MaddwdDot<V>, FourBit>::template gemm_tokens<IntTiles<V, MaddwdDot<V>, FourBit>::template FourBitTile,
                                                             MaxTokens, TokenNV, 1>(
        [&](int t) { return QuantizedParts<1>{{tokens(t)}}; }, tokens.count, w, y, 2 * y_stride, starts);
    zero_residual_outputs(x, w, y, y_stride);
  } else {
    IntTiles<V, MaddubsDot<V>, FourBit>::template gemm_four_bit<MaxRows, NV, MaxRows / 2, NV>(x, w, y, y_stride);
  }
}

// GGUF without vpdpbusd: tokens widened to int16 (MaddwdDot), one row and its residual as one
// token or (int8_activations) a row alone: vpmaddubsw would saturate on byte weights. Tiles of
// MaxTokens x NV groups.
template <class V, int MaxTokens, int NV, class Format>
void gemm_gguf_maddwd_of(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  using Tiles = IntTiles<V, MaddwdDot<V>, Format>;
  const WidenedTokens tokens = widen_tokens(x, w.k);
  int32_t* starts = tokens.running_sums + tokens.count * tokens.sums;
  Tiles::template gemm_tokens<Tiles::template FourBitTile, MaxTokens, NV, 1>(
      [&](int t) { return QuantizedParts<1>{{tokens(t)}}; }, tokens.count, w, y, x.quantized.parts * y_stride, starts);
  zero_residual_outputs(x, w, y, y_stride);
}

// Whether 16 levels (+ 128) are lowest .. lowest + 15 in order (GgufNibbleFormat).
inline bool consecutive_levels(const int8_t* levels) {
  for (int i = 1; i < kLevels; ++i)
    if (uint8_t(levels[i]) != uint8_t(levels[0]) + i) return false;
  return true;
}

// Calls run (a template lambda) with the GGUF format of w's held values and the groups it reads.
template <class V, class Run>
void for_gguf_values(const PackedGroups& w, Run run) {
  if (w.levels != nullptr && consecutive_levels(w.levels)) {
    PackedGroups nibbles = w;
    nibbles.value_offset = uint8_t(w.levels[0]);
    run.template operator()<GgufNibbleFormat<V>>(nibbles);
  } else if (w.levels != nullptr) {
    run.template operator()<GgufIndexedFormat<V>>(w);
  } else if (w.value_bits == 6) {
    run.template operator()<GgufPlanarFormat<V, 6>>(w);
  } else if (w.value_bits == 5) {
    run.template operator()<GgufPlanarFormat<V, 5>>(w);
  } else if (w.value_bits == 3) {
    run.template operator()<GgufPlanarFormat<V, 3>>(w);
  } else if (w.value_bits == 2) {
    run.template operator()<GgufPlanarFormat<V, 2>>(w);
  } else {
    run.template operator()<GgufFormat<V>>(w);
  }
}

// GGUF without vpdpbusd: values small enough for vpmaddubsw (GgufNibbleFormat's, value planes') in
// scale groups of whole partials as INT4 (gemm_four_bit_maddwd: at one token or on int8 rows), the
// others on widened tokens. Q6_K's planes on vpmaddubsw, not widened (avx2, one token, 3 layer
// calls: 100.9 -> 96.0 M instructions, bench/one_layer.py).
template <class V, int MaxRows, int NV, int MaxTokens, int TokenNV>
void gemm_gguf_maddwd(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  for_gguf_values<V>(w, [&]<class Format>(const PackedGroups& held) {
    if constexpr (MaddubsDot<V>::takes(Format::kMaxValue)) {
      if (held.scale_group % (8 * partial_lines<MaddubsDot<V>, Format>()) == 0)
        return gemm_four_bit_maddwd<V, Format, MaxRows, NV, MaxTokens, TokenNV>(x, held, y, y_stride);
    }
    gemm_gguf_maddwd_of<V, MaxTokens, TokenNV, Format>(x, held, y, y_stride);
  });
}

KT_NAMESPACE_END
