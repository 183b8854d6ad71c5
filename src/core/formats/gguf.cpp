// GGUF: llama.cpp's integer block types as int8 values with an fp32 scale and min per 16 or 32
// inputs (w = q * scale + min), held as the data allows (HeldLayout; the layouts: kernels.h):
// values as bytes (q + 128), 4-bit indices into 16 levels or 2, 3, 5 or 6-bit planes, scales as fp32
// or fp16, or factored (int8, 6 or 4-bit multiples of fp32 or fp16 factors), mins left out where all
// are 0.
// Every choice is exact, checked on the data at load.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "formats.h"
#include "gguf_levels.h"
#include "packed_positions.h"

KT_NAMESPACE_BEGIN
namespace {

// fp16 <-> fp32, scalar (the kernels convert with F16C, exactly as this does).
float half_value(uint16_t h) {
  const int exponent = (h >> 10) & 31, mantissa = h & 1023;
  const float magnitude = exponent == 0    ? std::ldexp(float(mantissa), -24)
                          : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                           : std::ldexp(float(1024 + mantissa), exponent - 25);
  return (h >> 15) ? -magnitude : magnitude;
}

// The fp16 whose value is v bit for bit (-0 too), or false.
bool half_of(float v, uint16_t& h) {
  if (!std::isfinite(v)) return false;
  const float a = std::fabs(v);
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (a < 0x1p-14f) {
    h = uint16_t(sign | int(std::nearbyint(a * 0x1p24f)));  // 1024: 2^-14, the first normal
  } else {
    int e;
    const float fraction = std::frexp(a, &e);  // a = fraction * 2^e, fraction in [0.5, 1)
    if (e - 1 + 15 > 30) return false;
    h = uint16_t(sign | (e - 1 + 15) << 10 | int(std::nearbyint((2 * fraction - 1) * 1024)));
  }
  return std::bit_cast<uint32_t>(half_value(h)) == std::bit_cast<uint32_t>(v);
}

bool is_half(float v) {
  uint16_t h;
  return half_of(v, h);
}

uint16_t half_bits(float v) {
  uint16_t h = 0;
  half_of(v, h);  // exact: checked at load
  return h;
}

float half_at(const uint8_t* halfs, int index) {
  uint16_t h;
  std::memcpy(&h, halfs + 2 * index, 2);
  return half_value(h);
}

float float_at(const uint8_t* floats, int index) {
  float f;
  std::memcpy(&f, floats + 4 * index, 4);
  return f;
}

// The field `index` of `bits` (4 or 6) bits of a bit string (kernels.h: row r of an entry at bits
// bits * r onwards).
int field_at(const uint8_t* bytes, int index, int bits) {
  const int bit = bits * index, shift = bit % 8;
  int v = bytes[bit / 8] >> shift;
  if (shift + bits > 8) v |= bytes[bit / 8 + 1] << (8 - shift);
  return v & ((1 << bits) - 1);
}

void set_field(uint8_t* bytes, int index, int bits, int value) {  // the bytes start zeroed
  const int bit = bits * index, shift = bit % 8;
  bytes[bit / 8] = uint8_t(bytes[bit / 8] | value << shift);
  if (shift + bits > 8) bytes[bit / 8 + 1] = uint8_t(bytes[bit / 8 + 1] | value >> (8 - shift));
}

// The multiples a factoring may use, lo..hi, and whether its factors are fp16.
struct Factoring {
  int lo, hi;
  bool half;
};
// Tried in turn for a whole projection: the fewest bytes first (kernels.h). 0..15: Q2_K's scales and
// mins; 0..63: Q4_K's and Q5_K's; -32..31: IQ4_XS's and Q3_K's scales (ls - 32); int8: Q6_K's.
constexpr Factoring kFactorings[] = {{0, 15, true},    {0, 15, false},  {0, 63, true},
                                     {-32, 31, true},  {-128, 127, true}, {0, 63, false},
                                     {-32, 31, false}, {-128, 127, false}};

Factoring factoring_of(const HeldLayout& layout) {
  if (layout.multiple_bits == 8) return {-128, 127, layout.half_factors};
  const int lo = -layout.multiple_bias;
  return {lo, lo + (1 << layout.multiple_bits) - 1, layout.half_factors};
}

void set_factoring(HeldLayout& layout, const Factoring& f) {
  layout.factored_scales = true;
  layout.half_factors = f.half;
  layout.multiple_bits = uint8_t(std::bit_width(unsigned(f.hi - f.lo)));  // 4, 6 or 8
  layout.multiple_bias = uint8_t(layout.multiple_bits == 8 ? 0 : -f.lo);
}

bool levels_of(const int8_t* values, size_t count, int8_t* levels) {
  bool seen[256] = {};
  for (size_t i = 0; i < count; ++i) seen[uint8_t(values[i] + 128)] = true;
  for (const auto& set : kLevelSets) {
    bool held[256] = {};
    for (int8_t level : set) held[uint8_t(level + 128)] = true;
    bool all = true;
    for (int v = 0; v < 256 && all; ++v) all = !seen[v] || held[v];
    if (!all) continue;
    for (int i = 0; i < kLevels; ++i) levels[i] = int8_t(set[i] + 128);  // as u8: level + 128
    return true;
  }
  return false;
}

bool within_levels(const HeldLayout& layout, const int8_t* values, size_t count) {
  bool held[256] = {};
  for (int8_t level : layout.levels) held[uint8_t(level)] = true;  // level + 128
  for (size_t i = 0; i < count; ++i)
    if (!held[uint8_t(values[i] + 128)]) return false;
  return true;
}

// The scales (entry 0) or mins (entry 1) of a canonical row's scale groups [first, first + n):
// pairs [groups][scale, min].
void entries_of(const float* pairs, int first, int n, int entry, float* out) {
  for (int i = 0; i < n; ++i) out[i] = pairs[2 * (first + i) + entry];
}

// Factors n values as multiples in f.lo..f.hi of one factor (an fp16 value where f.half):
// float(multiples[i]) * factor == values[i], exactly as the kernels compute it. `hint` (the largest
// value's multiple in the last block that factored) is tried first: a tensor's blocks mostly share
// it (Q4_K: 63, Q6_K: -128).
bool factor(const float* values, int n, const Factoring& range, float& factor_out, int8_t* multiples, int& hint) {
  int largest = 0;
  for (int i = 1; i < n; ++i)
    if (std::fabs(values[i]) > std::fabs(values[largest])) largest = i;
  const float top = values[largest];
  if (top == 0.0f) {  // all +0 or -0: a factor of 0 with their sign, where they share one
    factor_out = values[0];
    std::memset(multiples, 0, n);
    for (int i = 0; i < n; ++i)
      if (std::bit_cast<uint32_t>(values[i]) != std::bit_cast<uint32_t>(values[0])) return false;
    return true;
  }
  const auto try_multiple = [&](int m) {
    const float f = top / float(m);
    if (range.half && !is_half(f)) return false;
    for (int i = 0; i < n; ++i) {
      const float q = std::nearbyint(values[i] / f);
      if (!(q >= float(range.lo) && q <= float(range.hi))) return false;
      multiples[i] = int8_t(q);
      // What the kernels compute, bit for bit (the write-back gives the canonical tensors back as
      // loaded): an int8 0 times f is a 0 of f's sign, whatever q's sign (spelled out: GCC folds
      // float(int8_t(q)) to q under -fno-trapping-math).
      const float back = q == 0.0f ? std::copysign(0.0f, f) : q * f;
      if (std::bit_cast<uint32_t>(back) != std::bit_cast<uint32_t>(values[i])) return false;
    }
    factor_out = f;
    return true;
  };
  if (hint != 0 && hint >= range.lo && hint <= range.hi && try_multiple(hint)) return true;
  for (int m = range.hi; m >= range.lo; --m)
    if (m != 0 && m != hint && try_multiple(m)) {
      hint = m;
      return true;
    }
  return false;
}

// Calls visit(row, block, first group, groups, entry, values) for every block of every canonical row,
// entry 0 (scales) and, with mins, 1 (mins); stops at the first visit that returns false.
template <class Visit>
bool for_each_block(const float* pairs, size_t rows, int k, int scale_group, bool mins, Visit visit) {
  const int groups = k / scale_group, per_block = kGgufBlockInputs / scale_group;
  float values[kGgufBlockInputs / 16];  // 16: the smallest scale group
  for (size_t row = 0; row < rows; ++row)
    for (int first = 0; first < groups; first += per_block)
      for (int entry = 0; entry < gguf_entries(mins); ++entry) {
        const int n = std::min(per_block, groups - first);
        entries_of(pairs + row * groups * 2, first, n, entry, values);
        if (!visit(row, first / per_block, first, n, entry, values)) return false;
      }
  return true;
}

bool scales_factor(const float* pairs, size_t rows, int k, int scale_group, bool mins, const Factoring& range) {
  int hints[2] = {};
  int8_t multiples[kGgufBlockInputs / 16];
  float f;
  return for_each_block(pairs, rows, k, scale_group, mins, [&](size_t, int, int, int n, int entry, const float* v) {
    return factor(v, n, range, f, multiples, hints[entry]);
  });
}

// Whether every scale, and min where held, of n pairs is an fp16 value.
bool pairs_half(const float* pairs, size_t n, bool mins) {
  for (size_t i = 0; i < n; ++i)
    if (!is_half(pairs[2 * i]) || (mins && !is_half(pairs[2 * i + 1]))) return false;
  return true;
}

// ---- E4M3 scales (NVFP4's): every scale of a matrix fl(value(byte) * factor), byte an unsigned E4M3
// code, one fp32 factor per matrix.

// The values of the unsigned E4M3 codes 0 .. 0x7E (0x7F: NaN), increasing; as the kernels decode them.
struct E4m3Values {
  float of[0x7F];
  E4m3Values() {
    for (int b = 0; b < 0x7F; ++b) {
      const int e = b >> 3, m = b & 7;
      of[b] = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
    }
  }
};
const E4m3Values kE4m3;
constexpr int kE4m3Top = 0x7E;  // 448

// The code whose value times `factor` is `scale`, bit for bit, or -1: the code nearest scale / factor
// from its bits (a load checks every scale of a layer this way, several times), or a neighbour.
int e4m3_code(float scale, float factor) {
  const float q = scale / factor;
  if (!(q >= 0.0f && q < 2 * kE4m3.of[kE4m3Top])) return -1;
  int at;
  if (q < 0x1p-6f) {
    at = int(std::nearbyint(q * 512.0f));  // the subnormal codes m * 2^-9, and code 8 (2^-6)
  } else {
    const uint32_t bits = std::bit_cast<uint32_t>(q);
    at = (int(bits >> 23) - 127 + 7) * 8 + int((bits >> 20) & 7);  // the mantissa truncated
  }
  for (int b : {at, at + 1, at - 1})
    if (b >= 0 && b <= kE4m3Top && std::bit_cast<uint32_t>(kE4m3.of[b] * factor) == std::bit_cast<uint32_t>(scale))
      return b;
  return -1;
}

// Whether every scale of n is an E4M3 code times `factor`.
bool e4m3_factors(const float* pairs, size_t n, float factor) {
  for (size_t i = 0; i < n; ++i)
    if (e4m3_code(pairs[2 * i], factor) < 0) return false;
  return true;
}

// A factor that makes every one of the n scales (pairs[2i]; mins all +0) an unsigned E4M3 code times
// it, exactly, or 0. Where each scale is fl(code * g), a scale s of code c gives g to within 2 ulps as
// s / (c's mantissa): candidates from each mantissa and those neighbours are complete, and a few
// first distinct scales suffice. Each is scaled so that the largest scale is a code of exponent 8
// (codes shifted up stay exact, subnormals included).
float e4m3_factor(const float* pairs, size_t n) {
  float top = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float s = pairs[2 * i];
    if (!(s >= 0.0f) || std::bit_cast<uint32_t>(s) >> 31 || !std::isfinite(s)) return 0.0f;  // -0 too
    top = std::max(top, s);
  }
  if (top == 0.0f) return 1.0f;  // every scale +0: code 0
  constexpr int kTried = 4;
  float tried[kTried];
  int count = 0;
  for (size_t i = 0; i < n && count < kTried; ++i) {
    const float s = pairs[2 * i];
    if (s == 0.0f || std::find(tried, tried + count, s) != tried + count) continue;
    tried[count++] = s;
    for (int m = 0; m < 8; ++m) {
      float f = s / (1.0f + float(m) / 8.0f);
      int e;
      std::frexp(top / f, &e);  // top / f in [2^(e-1), 2^e): make it [256, 512)
      f = std::ldexp(f, e - 9);
      if (top / f > kE4m3.of[kE4m3Top]) f *= 2.0f;
      if (!std::isnormal(f)) continue;
      const uint32_t bits = std::bit_cast<uint32_t>(f);
      for (int ulps : {0, -1, 1, -2, 2}) {
        const float candidate = std::bit_cast<float>(bits + uint32_t(ulps));
        if (std::isnormal(candidate) && e4m3_factors(pairs, n, candidate)) return candidate;
      }
    }
  }
  return 0.0f;
}

// Whether every matrix's scales are E4M3 codes times a factor of its own (no mins).
bool e4m3_scales(const CanonicalMatrices& m) {
  const float* pairs = reinterpret_cast<const float*>(m.scales);
  const size_t per_matrix = size_t(m.rows) * (m.k / m.scale_group);
  for (size_t i = 0; i < m.count; ++i)
    if (e4m3_factor(pairs + 2 * i * per_matrix, per_matrix) == 0.0f) return false;
  return true;
}

// ---- Value planes: every value in [lowest, lowest + 2^bits), held as v = q - lowest.

int lowest_of(const HeldLayout& layout) { return int(uint8_t(layout.levels[0])) - kInt8Offset; }

// The planes' bits (2, 3, 5 or 6) that hold `count` values, and their lowest value into levels[0]
// (+ 128); 8 where they span more than 64. 5 bits only where a scale group is whole units of 32
// inputs (the kernels take a unit's plane line inside one scale group; 3 bits: two 16-input scale
// groups share one).
uint8_t plane_bits_of(const int8_t* values, size_t count, int scale_group, int8_t* levels) {
  int lowest = 127, highest = -128;
  for (size_t i = 0; i < count; ++i) {
    lowest = std::min<int>(lowest, values[i]);
    highest = std::max<int>(highest, values[i]);
  }
  const int span = highest - lowest + 1;
  const uint8_t bits = span <= 4                              ? 2
                       : span <= 8                            ? 3
                       : span <= 32 && scale_group % 32 == 0 ? 5
                       : span <= 64                           ? 6
                                                              : 8;
  if (bits != 8) levels[0] = int8_t(uint8_t(lowest + kInt8Offset));
  return bits;
}

bool within_planes(const HeldLayout& layout, const int8_t* values, size_t count) {
  const int lowest = lowest_of(layout), highest = lowest + (1 << layout.value_bits) - 1;
  bool all = true;
  for (size_t i = 0; i < count; ++i) all &= values[i] >= lowest && values[i] <= highest;
  return all;
}

// Row r of a group as value planes (kernels.h): per unit, its low lines' words and its plane word.
void pack_planar_row(const int8_t* row, int k, int r, int bits, int lowest, uint8_t* group) {
  const int low_bits = plane_low_bits(bits), high_bits = plane_high_bits(bits), per_unit = unit_inputs(bits);
  const int quads_per_line = 8 / low_bits, lines = plane_lines(bits);
  for (int u = 0; u * per_unit < k; ++u) {
    uint32_t words[4] = {}, plane = 0;
    for (int q = 0; q < per_unit / 4; ++q)
      for (int i = 0; i < 4; ++i) {
        const uint32_t v = uint8_t(row[u * per_unit + 4 * q + i] - lowest);
        words[q / quads_per_line] |= (v & ((1u << low_bits) - 1)) << (8 * i + low_bits * (q % quads_per_line));
        plane |= (v >> low_bits) << (8 * i + high_bits * q);
      }
    uint8_t* unit = group + size_t(u) * unit_lines(bits) * 64 + 4 * r;
    for (int l = 0; l < lines; ++l) std::memcpy(unit + l * 64, &words[l], 4);
    if (high_bits > 0) std::memcpy(unit + lines * 64, &plane, 4);
  }
}

// Whether any min is other than +0 (the min a layout without mins gives back).
bool has_mins(const float* pairs, size_t pair_count) {
  for (size_t i = 0; i < pair_count; ++i)
    if (std::bit_cast<uint32_t>(pairs[2 * i + 1]) != 0) return true;
  return false;
}

HeldLayout layout_of(const CanonicalMatrices& m) {
  HeldLayout layout;
  const size_t rows = m.count * m.rows;
  const float* pairs = reinterpret_cast<const float*>(m.scales);
  const int8_t* values = reinterpret_cast<const int8_t*>(m.values);
  // Planes of 2 or 3 bits ahead of 16 levels (4 bits), those ahead of wider planes.
  const uint8_t plane_bits = plane_bits_of(values, rows * m.k, m.scale_group, layout.levels.data());
  const bool levels = plane_bits > 3 && levels_of(values, rows * m.k, layout.levels.data());
  layout.value_bits = levels ? 4 : plane_bits;
  layout.mins = has_mins(pairs, rows * (m.k / m.scale_group));
  layout.e4m3_scales = !layout.mins && e4m3_scales(m);
  if (layout.e4m3_scales) return layout;
  for (const Factoring& range : kFactorings)
    if (scales_factor(pairs, rows, m.k, m.scale_group, layout.mins, range)) {
      set_factoring(layout, range);
      return layout;
    }
  layout.half_scales = pairs_half(pairs, rows * (m.k / m.scale_group), layout.mins);
  return layout;
}

bool layout_holds(const HeldLayout& layout, const CanonicalMatrices& m) {
  const size_t rows = m.count * m.rows;
  const float* pairs = reinterpret_cast<const float*>(m.scales);
  const int8_t* values = reinterpret_cast<const int8_t*>(m.values);
  const bool values_held = layout.value_bits == 8 ||
                           (layout.value_bits == 4 ? within_levels(layout, values, rows * m.k)
                                                   : within_planes(layout, values, rows * m.k));
  return values_held &&
         (layout.mins || !has_mins(pairs, rows * (m.k / m.scale_group))) &&
         (!layout.factored_scales ||
          scales_factor(pairs, rows, m.k, m.scale_group, layout.mins, factoring_of(layout))) &&
         (!layout.half_scales || pairs_half(pairs, rows * (m.k / m.scale_group), layout.mins)) &&
         (!layout.e4m3_scales || e4m3_scales(m));
}

size_t held_group_bytes(const HeldLayout& layout, int k) {
  if (layout.value_bits == 4) return indexed_group_bytes(k);
  return layout.value_bits == 8 ? size_t(k) * kGroupRows : planar_group_bytes(k, layout.value_bits);
}

size_t held_group_scale_bytes(const HeldLayout& layout, int k, int scale_group) {
  if (layout.e4m3_scales) return gguf_e4m3_scale_bytes(k, scale_group);
  return gguf_group_scale_bytes(layout, k, scale_group);
}

// One 16-row group's scales and mins (kernels.h), from canonical pairs [rows][k / G][scale, min].
void pack_scales(const HeldLayout& layout, const float* pairs, int rows, int k, int scale_group, int g,
                 uint8_t* group_scales, float matrix_factor) {
  const int groups = k / scale_group, entries = gguf_entries(layout.mins);
  if (layout.e4m3_scales) {  // padding rows: code 0
    std::memset(group_scales, 0, gguf_e4m3_scale_bytes(k, scale_group));
    const size_t first_row = size_t(g) * kGroupRows, real_rows = std::min<size_t>(kGroupRows, rows - first_row);
    for (size_t r = 0; r < real_rows; ++r)
      for (int s = 0; s < groups; ++s)
        group_scales[s * kGroupRows + r] =
            uint8_t(e4m3_code(pairs[2 * ((first_row + r) * groups + s)], matrix_factor));
    return;
  }
  std::memset(group_scales, 0, gguf_group_scale_bytes(layout, k, scale_group));
  const size_t first_row = size_t(g) * kGroupRows, real_rows = std::min<size_t>(kGroupRows, rows - first_row);
  const float* group_pairs = pairs + first_row * groups * 2;
  const auto store = [](uint8_t* at, int index, bool half, float v) {
    if (half) {
      const uint16_t h = half_bits(v);
      std::memcpy(at + 2 * index, &h, 2);
    } else {
      std::memcpy(at + 4 * index, &v, 4);
    }
  };
  if (!layout.factored_scales) {
    for (size_t r = 0; r < real_rows; ++r)
      for (int s = 0; s < groups; ++s)
        for (int entry = 0; entry < entries; ++entry)
          store(group_scales, gguf_entry_index(s, entry, layout.mins) + int(r), layout.half_scales,
                group_pairs[(r * groups + s) * 2 + entry]);
    return;
  }
  uint8_t* multiples = group_scales + gguf_multiples_offset(layout, k);
  uint8_t* factors = group_scales + gguf_factors_offset(layout, k, scale_group);
  const Factoring range = factoring_of(layout);
  int hints[2] = {};
  int8_t block_multiples[kGgufBlockInputs / 16];
  for_each_block(group_pairs, real_rows, k, scale_group, layout.mins,
                 [&](size_t r, int block, int first, int n, int entry, const float* v) {
                   float f;
                   factor(v, n, range, f, block_multiples, hints[entry]);  // factors: checked by layout_of
                   store(factors, gguf_entry_index(block, entry, layout.mins) + int(r), layout.half_factors, f);
                   for (int i = 0; i < n; ++i) {
                     const int at = gguf_entry_index(first + i, entry, layout.mins) + int(r);
                     if (layout.multiple_bits == 8)
                       multiples[at] = uint8_t(block_multiples[i]);
                     else
                       set_field(multiples, at, layout.multiple_bits, block_multiples[i] + layout.multiple_bias);
                   }
                   return true;
                 });
}

void pack_held(const HeldLayout& layout, const uint8_t* values, const uint8_t* scale_bytes, int rows, int k,
               int scale_group, uint8_t* packed, uint8_t* packed_scales, float* matrix_factor) {
  const int8_t* q = reinterpret_cast<const int8_t*>(values);
  const float* pairs = reinterpret_cast<const float*>(scale_bytes);
  // Found again per matrix (layout_of checked that every matrix has one).
  *matrix_factor = layout.e4m3_scales ? e4m3_factor(pairs, size_t(rows) * (k / scale_group)) : 1.0f;
  const size_t value_bytes = held_group_bytes(layout, k);
  const size_t scale_bytes_per_group = held_group_scale_bytes(layout, k, scale_group);
  uint8_t index_of[256] = {};  // level + 128 -> its first index
  for (int i = kLevels - 1; i >= 0; --i) index_of[uint8_t(layout.levels[i])] = uint8_t(i);
  // Padding rows have scale and min 0: any value is weight 0.
  const bool indexed = layout.value_bits == 4;
  const uint8_t padding = indexed ? uint8_t(index_of[kInt8Offset] * 0x11) : layout.value_bits == 8 ? kInt8Offset : 0;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * value_bytes;
    pack_scales(layout, pairs, rows, k, scale_group, g, packed_scales + g * scale_bytes_per_group, *matrix_factor);
    std::memset(group, padding, value_bytes);
    for (int r = 0; r < kGroupRows && size_t(g) * kGroupRows + r < size_t(rows); ++r) {
      const int8_t* row = q + (size_t(g) * kGroupRows + r) * k;
      if (layout.value_bits == 8) {
        pack_int8_row(row, k, r, group);
        continue;
      }
      if (!indexed) {
        pack_planar_row(row, k, r, layout.value_bits, lowest_of(layout), group);
        continue;
      }
      for (int c = 0; c < k; c += 8) {  // inputs c..c+7: one row word, c..c+3 in its low nibbles (k: whole 32s)
        uint8_t* word = group + nibble_position(c, r);
        for (int i = 0; i < 4; ++i)
          word[i] = uint8_t(index_of[uint8_t(row[c + i] + 128)] | index_of[uint8_t(row[c + 4 + i] + 128)] << 4);
      }
    }
  }
}

// Row r's scale (entry 0) or min (entry 1, where held) of scale group s, from one group's packed
// scales.
float packed_entry(const PackedGroups& w, const uint8_t* group_scales, int r, int s, int entry) {
  if (w.e4m3_scales) return kE4m3.of[group_scales[s * kGroupRows + r]] * w.scale_factor;
  const int at = gguf_entry_index(s, entry, w.mins) + r;
  if (!w.factored_scales) return w.half_scales ? half_at(group_scales, at) : float_at(group_scales, at);
  const uint8_t* multiples = group_scales + w.multiples_at;
  const int multiple =
      w.multiple_bits == 8 ? int(int8_t(multiples[at])) : field_at(multiples, at, w.multiple_bits) - w.multiple_bias;
  const uint8_t* factors = group_scales + w.factors_at;
  const int f = gguf_factor_index(s, entry, w.scale_group, w.mins) + r;
  return float(multiple) * (w.half_factors ? half_at(factors, f) : float_at(factors, f));
}

void unpack(const PackedGroups& w, const UnpackRegion& region) {
  for (int i = 0; i < region.rows; ++i) {
    const int row = region.row0 + i, r = row % kGroupRows;
    const uint8_t* group = w.values + size_t(row / kGroupRows) * w.group_bytes;
    const uint8_t* group_scales = w.scales + size_t(row / kGroupRows) * w.group_scale_bytes;
    uint8_t* dst = region.values + i * region.values_stride;
    if (w.levels != nullptr) {
      for (int c = 0; c < region.cols; ++c) {
        const int index = (group[nibble_position(region.k0 + c, r)] >> nibble_shift(region.k0 + c)) & 0xF;
        dst[c] = uint8_t(w.levels[index] - kInt8Offset);
      }
    } else if (w.value_bits != 8) {
      const int low_bits = plane_low_bits(w.value_bits), high_bits = plane_high_bits(w.value_bits);
      for (int c = 0; c < region.cols; ++c) {
        const PlanarPosition at = planar_position(region.k0 + c, r, w.value_bits);
        int v = (group[at.low] >> at.low_shift) & ((1 << low_bits) - 1);
        if (high_bits > 0) v |= ((group[at.plane] >> at.plane_shift) & ((1 << high_bits) - 1)) << low_bits;
        dst[c] = uint8_t(v + w.value_offset - kInt8Offset);
      }
    } else {
      unpack_int8_row(group, r, region.k0, region.cols, dst);
    }
    for (int s = 0; s < region.cols / w.scale_group; ++s) {
      const int group_s = region.k0 / w.scale_group + s;
      const float pair[2] = {packed_entry(w, group_scales, r, group_s, 0),
                             w.mins ? packed_entry(w, group_scales, r, group_s, 1) : 0.0f};
      std::memcpy(region.scales + i * region.scales_stride + s * sizeof(pair), pair, sizeof(pair));
    }
  }
}

constexpr HeldLayouts kGgufLayouts = {
    .of = layout_of,
    .holds = layout_holds,
    .group_bytes = held_group_bytes,
    .group_scale_bytes = held_group_scale_bytes,
    .pack = pack_held,
};

}  // namespace

extern const FormatTraits kGgufFormat = {
    .name = "GGUF",
    .value_bits = 8,
    .scale_type = ScaleType::kFloat32,
    .scale_groups = {16, 32, kEndOfList},
    .k_multiple = 32,
    .max_k = kMaxDimension,
    .activations = ActivationKind::kQuantized,
    .group_bytes = nullptr,  // held_layouts gives them
    .group_scale_bytes = nullptr,
    .pack = nullptr,
    .unpack = unpack,
    .gemm = &Kernels::gguf,
    .path = &KernelInfo::gguf_path,
    .scales_per_group = 2,
    .held_layouts = &kGgufLayouts,
};

KT_NAMESPACE_END
