// The avx512 build's entry points that the amx build replaces with tile kernels (kernels_amx/).
#include "paths.h"

KT_NAMESPACE_BEGIN

void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_bf16_avx512(x, w, y, y_stride);
}

void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_int8_avx512(x, w, y, y_stride);
}

KT_NAMESPACE_END
