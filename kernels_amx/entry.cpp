// The amx build's kernel interface (kernels.h): the AVX512 paths (kernels_avx512/paths.cpp) with
// every format but MXFP4 replaced by a tile GEMM, which falls back to those paths below its tile
// sizes. MXFP4 keeps the AVX512 kernel: faster on AMX hardware (gemm_four_bit.cpp).
#include <string>

#include "kernels_avx512/vec.h"
#include "tiles.h"

KT_NAMESPACE_BEGIN
namespace {

// FP8: blocks of tile rows on the AMX-BF16 tiles of the decoded weights; fewer rows on the AVX512
// path, which decodes in registers for decode-sized calls.
void gemm_fp8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (x.rows < amx::kBlockRows)
    avx512::paths().fp8(x, w, y, y_stride);
  else
    gemm_fp8_via_bf16<amx::gemm_bf16, avx512::decode_fp8>(x, w, y, y_stride);
}

Kernels with_tiles() {
  Kernels table = avx512::paths();
  table.bf16 = amx::gemm_bf16;
  table.int8 = amx::gemm_int8;
  table.int4 = amx::gemm_int4;
  table.fp8 = gemm_fp8;
  return table;
}

}  // namespace

const Kernels& kernels() {
  static const Kernels table = with_tiles();
  return table;
}

void init_kernels() { kernels(); }

KernelInfo kernel_info() {
  static const std::string bf16 =
      std::string("amx_bf16 tiles (blocks of 32 rows, k % 32 == 0), else ") + avx512::paths_info().bf16_path;
  static const std::string fp8 =
      std::string("amx_bf16 tiles on decoded weights (blocks of 32 rows), else ") + avx512::paths_info().fp8_path;
  static const std::string int8 = std::string("INT8: amx_int8 tiles (blocks of 32 rows, k % 64 == 0); INT4: amx_int8 "
                                              "tiles on widened nibbles (blocks of 32 rows, groups of 128 inputs); else ") +
                                  avx512::paths_info().int8_path;
  KernelInfo info = avx512::paths_info();
  info.isa = "amx";
  info.bf16_path = bf16.c_str();
  info.int8_path = int8.c_str();
  info.fp8_path = fp8.c_str();
#ifdef KT_AMX_EMULATED
  info.emulated_tile_products = amx::EmulatedTiles::products;
#endif
  return info;
}

KT_NAMESPACE_END
