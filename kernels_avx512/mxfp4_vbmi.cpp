// MXFP4 on vpdpbusd with its codes looked up by vpermb: compiled with -mavx512vnni -mavx512vbmi
// (CMakeLists.txt), run only after CPUID reported both (paths.cpp).
#include "dpbusd.h"

KT_NAMESPACE_BEGIN
namespace avx512 {
namespace {

// vpermb indexes a 64-byte table by the low 6 bits of each byte: with four copies of the 16 values,
// the bits above a nibble need not be masked off (two instructions fewer per line than vpshufb;
// one core, 768 x 2048 in cache: 32 rows 204 -> 213 GOP/s, one row 129 -> 142).
struct Mxfp4Vbmi : Mxfp4Format<Vec> {
  static __m512i low_values(__m512i bytes, __m512i /*low_nibbles*/) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kValues)));
    return _mm512_permutexvar_epi8(bytes, table);
  }
};

}  // namespace

void gemm_mxfp4_vpdpbusd_vbmi(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  gemm_four_bit<Mxfp4Vbmi>(x, w, y, y_stride);
}

}  // namespace avx512
KT_NAMESPACE_END
