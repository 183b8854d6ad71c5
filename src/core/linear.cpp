#include "linear.h"

#include <chrono>
#include <cstring>

#include "activation_rows.h"

KT_NAMESPACE_BEGIN

double linear(const FormatTraits& format, const bf16_t* x, int m, int k, SourceProjection w, int n, float* y,
              int repeats, bool int8_activations) {
  PackedProjection packed;
  packed.allocate(format, 1, n, k, w.scale_group, w.zeros != nullptr);
  pack_matrix(format, w, 0, packed, 0);
  const int stride = round_up(k, 32), y_stride = packed_groups(n) * kGroupRows;
  const bool quantize = format.quantized_activations();
  QuantizedBuffer quantized;
  quantized.parts = quantize && !int8_activations ? 2 : 1;
  AlignedBuffer<bf16_t> rows(size_t(m) * stride);
  AlignedBuffer<float> out(size_t(m) * quantized.parts * y_stride);
  AlignedBuffer<uint8_t> scratch(kernel_scratch_bytes(m * quantized.parts, k));
  if (quantize) quantized.reserve(m, k);
  for (int i = 0; i < m; ++i) {
    std::memcpy(rows.data() + size_t(i) * stride, x + size_t(i) * k, k * sizeof(bf16_t));
    std::memset(rows.data() + size_t(i) * stride + k, 0, (stride - k) * sizeof(bf16_t));
    if (quantize) quantized.quantize(i, x + size_t(i) * k, k, format);
  }
  Activations activations{rows.data(), size_t(stride), nullptr, m * quantized.parts};
  if (quantize) activations.quantized = quantized.view();
  activations.scratch = scratch.data();
  const GemmFn gemm = kernels().*format.gemm;
  const PackedGroups all = packed.groups(0, 0, packed_groups(n));
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; ++r) gemm(activations, all, out.data(), y_stride);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  sum_parts(out.data(), m, quantized.parts, y_stride, y_stride);
  for (int i = 0; i < m; ++i) std::memcpy(y + size_t(i) * n, out.data() + size_t(i) * y_stride, n * sizeof(float));
  return seconds / repeats;
}

KT_NAMESPACE_END
