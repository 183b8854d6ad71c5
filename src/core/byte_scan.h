// Byte loops the checkpoint readers run over every weight of a layer (kt_kernel/formats.py), in the
// engine's library so that each build compiles them with its ISA's flags (bindings_load.cpp binds them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

KT_NAMESPACE_BEGIN

// The index of the first byte b of data[0, size) with (b & mask) == value, or -1.
int64_t first_byte_match(const uint8_t* data, size_t size, uint8_t mask, uint8_t value);

// out[2i] = table[in[i] & 15], out[2i + 1] = table[in[i] >> 4]: each byte's two 4-bit codes, the low
// nibble first, looked up in a table of 16 bytes.
void expand_nibbles(const uint8_t* in, size_t size, const uint8_t* table, uint8_t* out);

// out[i] = table[in[i]], a table of 256 bytes (in and out may be the same).
void map_bytes(const uint8_t* in, size_t size, const uint8_t* table, uint8_t* out);

KT_NAMESPACE_END
