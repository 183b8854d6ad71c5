// The checkpoint readers' byte loops (byte_scan.h) bound with the GIL released: a pass over memory
// where torch would take several passes and temporaries of eight bytes per weight.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "byte_scan.h"

namespace nb = nanobind;

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using BytesOut = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;

}  // namespace

void bind_load_helpers(nb::module_& m) {
  m.def(
      "first_byte_match",
      [](Bytes data, int mask, int value) {
        const uint8_t* bytes = data.data();
        const size_t size = data.size();
        nb::gil_scoped_release release;
        return kt::first_byte_match(bytes, size, uint8_t(mask), uint8_t(value));
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
        kt::expand_nibbles(in, size, codes, dst);
      },
      nb::arg("packed"), nb::arg("table"), nb::arg("out"),
      "out[2i], out[2i + 1] = table[packed[i] & 15], table[packed[i] >> 4] (C-contiguous uint8 arrays).");
  m.def(
      "map_bytes",
      [](Bytes data, Bytes table, BytesOut out) {
        if (table.size() != 256) throw std::invalid_argument("map_bytes needs a table of 256 bytes");
        if (out.size() != data.size()) throw std::invalid_argument("map_bytes: out must hold a byte per input byte");
        const uint8_t *in = data.data(), *bytes = table.data();
        uint8_t* dst = out.data();
        const size_t size = data.size();
        nb::gil_scoped_release release;
        kt::map_bytes(in, size, bytes, dst);
      },
      nb::arg("data"), nb::arg("table"), nb::arg("out"), "out[i] = table[data[i]] (C-contiguous uint8 arrays).");
}
