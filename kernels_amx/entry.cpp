// The amx build's kernel interface (kernels.h): the AVX512 paths (kernels_avx512/paths.cpp) with
// the formats that have a tile GEMM (the fields with_tiles sets; the others keep the AVX512 path)
// replaced by it, which falls back to those paths below its tile sizes (decode) and where its tiles
// do not apply.
#include <string>

#include "kernels_avx512/vec.h"
#include "tiles.h"

KT_NAMESPACE_BEGIN
namespace {

double peak_probe(PeakOp op, int64_t iterations) {
  return op == PeakOp::kTileBf16 ? amx::tile_bf16_peak_probe(iterations) : avx512::peak_probe(op, iterations);
}

Kernels with_tiles() {
  Kernels table = avx512::paths();
  table.peak = peak_probe;
  table.bf16 = amx::gemm_bf16;
  table.mxfp4 = amx::gemm_mxfp4;
  table.fp8 = amx::gemm_fp8;
  table.int4 = amx::gemm_int4;
  table.int8 = amx::gemm_int8;
  return table;
}

}  // namespace

const Kernels& kernels() {
  static const Kernels table = with_tiles();
  return table;
}

void init_kernels() { kernels(); }

KernelInfo kernel_info() {
  const KernelInfo avx512 = avx512::paths_info();
  static const std::string bf16 =
      std::string("amx_bf16 tiles (16 rows or more, k % 32 == 0), else ") + avx512.bf16_path;
  static const std::string fp8 =
      std::string("amx_bf16 tiles on decoded weights (16 rows or more, k % 32 == 0), else ") + avx512.fp8_path;
  static const std::string mxfp4 =
      std::string("exact activations: amx_bf16 tiles on decoded weights (16 rows or more); else ") + avx512.mxfp4_path;
  static const std::string int8 =
      std::string("INT8: amx_int8 tiles (16 rows or more, k % 64 == 0); INT4: amx_bf16 tiles on decoded weights "
                  "(exact activations, 16 rows or more, groups of 64 or 128, no zero points), else amx_int8 tiles "
                  "on widened nibbles (blocks of 32 rows, groups of 128 inputs); else ") +
      avx512.int8_path;
  KernelInfo info = avx512;
  info.isa = "amx";
  info.bf16_path = bf16.c_str();
  info.int8_path = int8.c_str();
  info.fp8_path = fp8.c_str();
  info.mxfp4_path = mxfp4.c_str();
  info.gguf_path = avx512.int8_path;  // no tiles: the AVX512 kernel
#ifdef KT_AMX_EMULATED
  info.emulated_tile_products = amx::EmulatedTiles::products;
#endif
  return info;
}

KT_NAMESPACE_END
