// Byte loops the checkpoint readers run on every weight of a layer (kt_kernel/formats.py): done here
// with the GIL released, they cost a pass over memory where torch's would cost several passes and
// temporaries of eight bytes per weight. Compiled with the module (no ISA flags): plain loops.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace nb = nanobind;

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using BytesOut = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;

// The index of the first byte b with (b & mask) == value, or -1. Blocks are tested whole (a loop
// without an early exit vectorizes), the first hit found in its block.
int64_t first_byte_match(const uint8_t* data, size_t size, uint8_t mask, uint8_t value) {
  constexpr size_t kBlock = 4096;
  for (size_t start = 0; start < size; start += kBlock) {
    const size_t end = start + kBlock < size ? start + kBlock : size;
    uint8_t hit = 0;
    for (size_t i = start; i < end; ++i) hit |= uint8_t((data[i] & mask) == value);
    if (!hit) continue;
    for (size_t i = start; i < end; ++i)
      if ((data[i] & mask) == value) return int64_t(i);
  }
  return -1;
}

// out[2i] = table[in[i] & 15], out[2i + 1] = table[in[i] >> 4]: each byte's two 4-bit codes, the
// low nibble first, looked up in a table of 16 bytes.
void expand_nibbles(const uint8_t* in, size_t size, const uint8_t* table, uint8_t* out) {
  uint16_t pairs[256];  // both codes of a byte at once, as they lie in memory (little-endian)
  for (int b = 0; b < 256; ++b) pairs[b] = uint16_t(table[b & 15] | table[b >> 4] << 8);
  for (size_t i = 0; i < size; ++i) std::memcpy(out + 2 * i, &pairs[in[i]], 2);
}

}  // namespace

void bind_load_helpers(nb::module_& m) {
  m.def(
      "first_byte_match",
      [](Bytes data, int mask, int value) {
        const uint8_t* bytes = data.data();
        const size_t size = data.size();
        nb::gil_scoped_release release;
        return first_byte_match(bytes, size, uint8_t(mask), uint8_t(value));
      },
      nb::arg("data"), nb::arg("mask"), nb::arg("value"),
      "The flat index of the first byte b of a C-contiguous uint8 array with (b & mask) == value, or -1.");
  m.def(
      "expand_nibbles",
      [](Bytes packed, Bytes table, BytesOut out) {
        if (table.size() != 16) throw std::invalid_argument("expand_nibbles needs a table of 16 bytes");
        if (out.size() != 2 * packed.size())
          throw std::invalid_argument("expand_nibbles: out must hold two bytes per input byte");
        const uint8_t *in = packed.data(), *codes = table.data();
        uint8_t* dst = out.data();
        const size_t size = packed.size();
        nb::gil_scoped_release release;
        expand_nibbles(in, size, codes, dst);
      },
      nb::arg("packed"), nb::arg("table"), nb::arg("out"),
      "out[2i], out[2i + 1] = table[packed[i] & 15], table[packed[i] >> 4] (C-contiguous uint8 arrays).");
}
