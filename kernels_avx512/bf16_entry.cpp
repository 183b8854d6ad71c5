// gemm_bf16 of the avx512 build (the amx build defines its own in kernels_amx/).
#include "paths.h"

KT_NAMESPACE_BEGIN

void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_bf16_avx512(x, w, y, y_stride);
}

KT_NAMESPACE_END
