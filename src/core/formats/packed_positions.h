// Where the packed layouts of kernels.h put an input of a 16-row group: the INT8 layout's bytes (INT8's
// and GGUF's values, stored as q + 128) and the INT4 layout's nibbles (INT4's values, GGUF's indices).
#pragma once

#include <cstring>

#include "kernels.h"

KT_NAMESPACE_BEGIN

// Where input c of row r lies in its 16-row group.
inline size_t int8_position(int c, int r) { return size_t(c / 4) * 64 + 4 * r + c % 4; }

// The byte holding input c of row r in the INT4 layout, and the shift of its nibble there (inputs
// 8j..8j+3 in a row word's low nibbles, 8j+4..8j+7 in its high ones).
inline size_t nibble_position(int c, int r) { return size_t(c / 8) * 64 + 4 * r + c % 4; }
inline int nibble_shift(int c) { return 4 * ((c % 8) / 4); }

// GGUF's value planes of `bits` bits (kernels.h): the byte holding input c's low bits and their
// shift there, and the byte of its plane line holding its high bits and their first bit there.
struct PlanarPosition {
  size_t low, plane;
  int low_shift, plane_shift;
};
inline PlanarPosition planar_position(int c, int r, int bits) {
  const int per_unit = unit_inputs(bits), quad = c % per_unit / 4, low_bits = plane_low_bits(bits);
  const int quads_per_line = 8 / low_bits;
  const size_t unit = size_t(c / per_unit) * unit_lines(bits) * 64 + 4 * r + c % 4;
  return {unit + size_t(quad / quads_per_line) * 64, unit + size_t(plane_lines(bits)) * 64,
          low_bits * (quad % quads_per_line), plane_high_bits(bits) * quad};
}

inline void pack_int8_row(const int8_t* q, int k, int r, uint8_t* group) {
  static_assert(kInt8Offset == 128, "q + 128 is q with its top bit flipped");
  const int whole = k / 4 * 4;
  for (int c = 0; c < whole; c += 4) {  // four inputs: one word of the row
    uint32_t word;
    std::memcpy(&word, q + c, sizeof(word));
    word ^= 0x80808080u;
    std::memcpy(group + int8_position(c, r), &word, sizeof(word));
  }
  for (int c = whole; c < k; ++c) group[int8_position(c, r)] = uint8_t(q[c] + kInt8Offset);
}

// Inputs [k0, k0 + cols) of row r of a group, as canonical int8 bytes.
inline void unpack_int8_row(const uint8_t* group, int r, int k0, int cols, uint8_t* dst) {
  for (int c = 0; c < cols; ++c) dst[c] = uint8_t(group[int8_position(k0 + c, r)] - kInt8Offset);
}

KT_NAMESPACE_END
