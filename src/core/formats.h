// Weight formats: everything the engine, the bindings and the Python registry need to know about a
// format is one FormatTraits entry, defined next to the format's packing code in formats/<name>.cpp
// and listed once in formats.cpp. The packed layouts the kernels read are described in kernels.h.
// Nothing outside those files branches on the format.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "kernels.h"

KT_NAMESPACE_BEGIN

// How a format stores its scales in the canonical layout.
enum class ScaleType { kNone, kE8M0, kFloat32 };

// The activations a format's kernels read (Activations): bf16 rows, or rows quantized to int8
// (QuantizedRows), optionally with each octet in the packed MXFP4 words' order (kernels.h).
enum class ActivationKind { kBf16, kQuantized, kQuantizedOctetOrder };

// Rows [row0, row0 + rows) and inputs [k0, k0 + cols) of one packed matrix, written as canonical
// rows of `cols` inputs: row i at values + i * values_stride bytes and, for the formats with scales,
// its scales at scales + i * scales_stride bytes. k0 and cols must keep scale groups whole.
// Destinations need no alignment.
struct UnpackRegion {
  int row0 = 0, rows = 0, k0 = 0, cols = 0;
  uint8_t* values = nullptr;
  size_t values_stride = 0;
  uint8_t* scales = nullptr;
  size_t scales_stride = 0;
};

// A format's canonical (unpacked) layout of one matrix W[rows][k]: values [rows][k * value_bits / 8]
// bytes (4-bit formats: the LOW nibble holds the even input), and scales [rows][scales per row] of
// scale_type: one per row when the scale group is 0, else scales_per_group per `scale group` inputs.
constexpr int kEndOfList = -1;

// How a projection is held, where its format chooses by the data (GGUF, kernels.h): values as bytes
// (value_bits 8), 4-bit indices into `levels` (each + 128; value_bits 4) or value planes of 5 or 6
// bits (levels[0]: the lowest value + 128, the rest 0), scales factored or as E4M3 bytes times a
// factor per matrix, mins left out where every min is 0; fp16 entries or factors and 6-bit
// multiples where exact.
struct HeldLayout {
  uint8_t value_bits = 8;
  alignas(16) std::array<int8_t, kLevels> levels{};
  bool factored_scales = false;
  bool mins = true;
  bool e4m3_scales = false;
  bool half_scales = false, half_factors = false;
  uint8_t multiple_bits = 8, multiple_bias = 0;
};

// Canonical matrices (rows x k) of one projection (FormatTraits' layout), `count` of them.
struct CanonicalMatrices {
  const uint8_t* values;
  const uint8_t* scales;
  size_t count;
  int rows, k, scale_group;
};

// A format's choice of layouts: `of` the layout that holds every matrix exactly, `holds` whether a
// layout chosen before holds more matrices (a later part of a load), the packed bytes of one group
// and pack (FormatTraits::pack's arguments) in a layout; pack sets the matrix's factor (its outputs
// are multiplied by it: PackedGroups::scale_factor).
struct HeldLayouts {
  HeldLayout (*of)(const CanonicalMatrices& matrices);
  bool (*holds)(const HeldLayout& layout, const CanonicalMatrices& matrices);
  size_t (*group_bytes)(const HeldLayout& layout, int k);
  size_t (*group_scale_bytes)(const HeldLayout& layout, int k, int scale_group);
  void (*pack)(const HeldLayout& layout, const uint8_t* values, const uint8_t* scales, int rows, int k,
               int scale_group, uint8_t* packed, uint8_t* packed_scales, float* factor);
};

struct FormatTraits {
  const char* name;  // the method name (Python's registry adds the aliases)
  int value_bits;
  ScaleType scale_type;
  // The scale groups a checkpoint may use, up to kEndOfList: 0 = one scale per row, n = one per n inputs.
  std::array<int, 4> scale_groups;
  int k_multiple;  // hidden and intermediate sizes must be multiples of this
  int max_k;                        // ... and at most this
  ActivationKind activations;
  // Packed bytes of one 16-row group (kernels.h), of its values and of its scales, and pack (these
  // three null where held_layouts gives them).
  size_t (*group_bytes)(int k);
  size_t (*group_scale_bytes)(int k, int scale_group);
  // Canonical matrix -> packed groups (zero rows pad the last group).
  void (*pack)(const uint8_t* values, const uint8_t* scales, int rows, int k, int scale_group, uint8_t* packed,
               uint8_t* packed_scales);
  // The inverse of pack for a region; w: the whole matrix from its first group.
  void (*unpack)(const PackedGroups& w, const UnpackRegion& region);
  GemmFn Kernels::*gemm;  // this format's GEMM in the build's kernel table
  const char* KernelInfo::*path;  // how that GEMM computes, in words (kernel_info)
  // Formats with zero points (INT4): canonical int8 offsets [rows][k / scale_group] -> packed
  // groups (kernels.h), group_scale_bytes(k, scale_group) bytes per group; null for the others.
  void (*pack_zeros)(const int8_t* zeros, int rows, int k, int scale_group, uint8_t* packed_zeros) = nullptr;
  // Canonical values per scale group: 2 where each group has a scale and a min (GGUF).
  int scales_per_group = 1;
  // Formats that choose how to hold each projection by its data (GGUF): null for the others.
  const HeldLayouts* held_layouts = nullptr;

  bool has_scales() const { return scale_type != ScaleType::kNone; }
  bool has_zero_points() const { return pack_zeros != nullptr; }
  bool quantized_activations() const { return activations != ActivationKind::kBf16; }
  size_t scale_bytes() const { return scale_type == ScaleType::kFloat32 ? 4 : scale_type == ScaleType::kE8M0 ? 1 : 0; }
  size_t row_bytes(int k) const { return size_t(k) * value_bits / 8; }
  int scales_per_row(int k, int scale_group) const {
    return !has_scales() ? 0 : scale_group == 0 ? 1 : scales_per_group * scale_groups_per_row(k, scale_group);
  }
  std::vector<int> allowed_scale_groups() const {
    std::vector<int> groups;
    for (size_t i = 0; i < scale_groups.size() && scale_groups[i] != kEndOfList; ++i) groups.push_back(scale_groups[i]);
    return groups;
  }
  // Inputs an unpacked region must keep together (a scale group; 1 without groups).
  int unpack_block(int scale_group) const { return scale_group > 0 ? scale_group : 1; }
};

// The format of a method name (exact, upper case); invalid_argument listing the known ones.
const FormatTraits& format_named(const std::string& name);
const std::vector<const FormatTraits*>& all_formats();

// Throws std::logic_error naming the first format of all_formats() whose GEMM (Kernels) or path in
// words (KernelInfo) this build leaves null. Run once at module load, after init_kernels: a build
// that lacks a format then fails to import instead of crashing, or reporting another's path.
void require_kernels_for_every_format();

// The scale group of a matrix of `format` with k inputs whose canonical scales hold `scales_per_row`
// scales per row; invalid_argument naming `what` when the format takes no such scales.
int scale_group_of(const FormatTraits& format, int k, size_t scales_per_row, const std::string& what);

KT_NAMESPACE_END
