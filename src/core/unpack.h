// Unpacking: the inverse of the pack_<format> functions of kernels.h, for writing an expert's
// weights back in the canonical layout (SGLang uploads CPU experts to the GPU this way). Kept apart
// from pack.cpp, which also holds the activation quantization.
#pragma once

#include "kernels.h"

KT_NAMESPACE_BEGIN

// Rows [row0, row0 + rows) and inputs [k0, k0 + cols) of one packed matrix, written as canonical
// rows of `cols` inputs: row i at values + i * values_stride bytes and, for the formats with scales,
// its scales at scales + i * scales_stride bytes (MXFP4: cols / 32 E8M0 bytes; INT8: one float, the
// row's; INT4: cols / group floats). MXFP4 and INT4 need k0 and cols to be multiples of the scale
// block (32, w.scale_group). Destinations need no alignment.
struct UnpackRegion {
  int row0 = 0, rows = 0, k0 = 0, cols = 0;
  uint8_t* values = nullptr;
  size_t values_stride = 0;
  uint8_t* scales = nullptr;
  size_t scales_stride = 0;
};

// w: the whole matrix, from its first group (PackedProjection::groups(expert, 0, all)).
void unpack_bf16(const PackedGroups& w, const UnpackRegion& region);
void unpack_mxfp4(const PackedGroups& w, const UnpackRegion& region);
void unpack_int8(const PackedGroups& w, const UnpackRegion& region);
void unpack_int4(const PackedGroups& w, const UnpackRegion& region);

KT_NAMESPACE_END
