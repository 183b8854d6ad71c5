// AVX512 MXFP4 GEMM: the 4-bit integer tiles (src/core/int_tiles.h) with E2M1 codes looked up as
// integers by vpshufb, multiplied with int8 activations by vpdpbusd where the CPU has AVX512_VNNI
// (vpdpbusd.cpp), else by vpmaddubsw (plain AVX512BW) here.
#include "int_tiles.h"
#include "paths.h"

KT_NAMESPACE_BEGIN

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (use_vpdpbusd())
    gemm_mxfp4_vpdpbusd(x, w, y, y_stride);
  else
    gemm_mxfp4_maddubs(x, w, y, y_stride);
}

KT_NAMESPACE_END
