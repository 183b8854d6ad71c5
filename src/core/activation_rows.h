// The activation rows of the integer formats, quantized per row, and the sum of their parts.
#pragma once

#include <cstdint>

#include "common.h"
#include "formats.h"
#include "kernels.h"

KT_NAMESPACE_BEGIN

// Activation rows quantized per row for the integer formats (storage behind QuantizedRows). Each
// row is held by `parts` quantized rows (kernels.h): 2, the row and its residual, unless the
// caller opted into plain int8 activations (1). Row r's parts are quantized rows r * parts + p.
struct QuantizedBuffer {
  AlignedBuffer<int8_t> values;
  AlignedBuffer<float> scales;
  AlignedBuffer<int32_t> running_sums;
  size_t stride = 0;
  int parts = 2;

  void reserve(int rows, int k);
  // Row `row` from x (k values), in the order `format`'s kernels read (MXFP4: octet order).
  void quantize(int row, const bf16_t* x, int k, const FormatTraits& format);
  // The quantized rows from row `first_row`'s first part on.
  QuantizedRows view(int first_row = 0) const;
  // Row `row`'s parts from row `src_row` of src (the same stride and parts).
  void copy_row(int row, const QuantizedBuffer& src, int src_row);
  // Zeros rows [first, first + count).
  void zero_rows(int first, int count);
  // Frees the rows (they grow back with reserve); stride and parts are kept.
  void release();
};

// Adds each row's `parts` consecutive output rows of a GEMM on QuantizedBuffer rows (rows * parts
// rows of `cols` floats, row stride `stride`) into its first `rows` rows.
void sum_parts(float* y, int rows, int parts, int cols, size_t stride);

KT_NAMESPACE_END
