#include "activation_rows.h"

#include <cstring>

KT_NAMESPACE_BEGIN

void QuantizedBuffer::reserve(int rows, int k) {
  stride = round_up(k, 64) + kRowPadBytes;
  const size_t quantized_rows = size_t(rows) * parts;
  values.reserve(quantized_rows * stride);
  scales.reserve(quantized_rows);
  running_sums.reserve(quantized_rows * running_sums_per_row(stride));
}

void QuantizedBuffer::quantize(int row, const bf16_t* x, int k, const FormatTraits& format) {
  auto out = [&](size_t quantized_row) {
    return QuantizedRowOut{values.data() + quantized_row * stride, scales.data() + quantized_row,
                           running_sums.data() + quantized_row * running_sums_per_row(stride)};
  };
  const size_t first = size_t(row) * parts;
  const QuantizedRowOut residual = out(first + 1);
  quantize_activation_row(x, k, int(stride), out(first), parts == 2 ? &residual : nullptr);
  if (format.activations == ActivationKind::kQuantizedOctetOrder)
    for (int p = 0; p < parts; ++p) order_octets_for_mxfp4(out(first + p).values, int(stride));
}

void QuantizedBuffer::copy_row(int row, const QuantizedBuffer& src, int src_row) {
  const size_t to = size_t(row) * parts, from = size_t(src_row) * parts, sums = running_sums_per_row(stride);
  std::memcpy(values.data() + to * stride, src.values.data() + from * stride, parts * stride);
  std::memcpy(scales.data() + to, src.scales.data() + from, parts * sizeof(float));
  std::memcpy(running_sums.data() + to * sums, src.running_sums.data() + from * sums, parts * sums * sizeof(int32_t));
}

void QuantizedBuffer::zero_rows(int first, int count) {
  const size_t from = size_t(first) * parts, rows = size_t(count) * parts, sums = running_sums_per_row(stride);
  std::memset(values.data() + from * stride, 0, rows * stride);
  std::memset(scales.data() + from, 0, rows * sizeof(float));
  std::memset(running_sums.data() + from * sums, 0, rows * sums * sizeof(int32_t));
}

void QuantizedBuffer::release() {
  values.release();
  scales.release();
  running_sums.release();
}

QuantizedRows QuantizedBuffer::view(int first_row) const {
  const size_t first = size_t(first_row) * parts;
  return {values.data() + first * stride, scales.data() + first,
          running_sums.data() + first * running_sums_per_row(stride), stride, parts};
}

void sum_parts(float* y, int rows, int parts, int cols, size_t stride) {
  if (parts == 1) return;
  for (int i = 0; i < rows; ++i) {
    float* dst = y + size_t(i) * stride;
    const float* src = y + size_t(i) * parts * stride;
    if (dst != src) std::memcpy(dst, src, cols * sizeof(float));  // row i * parts > i: not yet overwritten
    for (int p = 1; p < parts; ++p) {
      const float* part = src + size_t(p) * stride;
      for (int c = 0; c < cols; ++c) dst[c] += part[c];
    }
  }
}

KT_NAMESPACE_END
