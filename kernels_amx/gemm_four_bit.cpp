// INT4 on AMX-INT8 tiles (tdpbsud: s8 activations x u8 weights), for what gemm_int4 (tile_gemm.cpp)
// leaves to them: zero points, or int8_activations; blocks of 32 quantized activation rows and scale
// groups of at least kMinTileScaleInputs inputs; the AVX512 kernel for the rest. Exact like it: the
// activations are the same int8 rows (two per row by default, the residual included), and the
// integer sums are the same.
//
// Per pair of groups, the weights are widened once into the INT8 tile layout (kernels.h): a 4-bit
// line c (inputs 8c..8c+7 of 16 rows) gives quad 2c from its low nibbles and quad 2c + 1 from its
// high ones (the nibbles are q + 8 already). Then, per block of 32 rows and per scale group, the C
// tiles sum the group's inputs, are stored, corrected for the weight offset (or the zero points)
// times the activations' sums, scaled and added in fp32.
#include <algorithm>

#include "kernels_avx512/vec.h"
#include "kernels_common/int_tiles.h"
#include "tiles.h"

KT_NAMESPACE_BEGIN
namespace amx {
namespace {

using V = avx512::Vec;
// Scale groups of fewer inputs take the AVX512 kernel: 32-input ones were slower on these tiles
// (measured with MXFP4's blocks on a 16-core Xeon), 128-input ones faster; 64 was not measured.
constexpr int kMinTileScaleInputs = 128;
constexpr int kLineBytes = 64;  // a 4-bit line (8 inputs) or an INT8 quad line, 16 rows each
constexpr int kBlockOutputs = kBlockGroups * kGroupRows;

// A group's k inputs: 4-bit lines -> k / 4 quad lines of u8 values.
void widen_group(const uint8_t* lines, int k, uint8_t* quads) {
  const V::Int low_nibbles = V::set1(kLowNibbles);
  for (int c = 0; c < k / 8; ++c) {
    const V::Int raw = V::load(lines + size_t(c) * kLineBytes);
    _mm512_storeu_si512(quads + size_t(2 * c) * kLineBytes, V::and_(raw, low_nibbles));
    _mm512_storeu_si512(quads + size_t(2 * c + 1) * kLineBytes,
                        V::and_(V::srli_epi32(raw, 4), low_nibbles));
  }
}

// The inputs first .. first + count of 32 contiguous quantized rows (row stride x_bytes) x the widened
// groups g, g + 1: sums[32][32] int32.
void tile_sums(const int8_t* x, size_t x_bytes, const uint8_t* quads0, const uint8_t* quads1, int first, int count,
               int32_t* sums) {
  block_product(x + first, x_bytes, quads0 + size_t(first / 4) * kLineBytes, quads1 + size_t(first / 4) * kLineBytes,
                count, block_dots_s8u8);
  store_block(sums, kBlockOutputs * sizeof(int32_t));
}

}  // namespace

void gemm_int4_on_int8_tiles(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  using Int4 = Int4Format<V>;
  auto avx512 = [&](const Activations& xs, const PackedGroups& ws, float* ys) {
    avx512::paths().int4(xs, ws, ys, y_stride);
  };
  const int per_scale = Int4::inputs_per_scale(w);
  if (per_scale < kMinTileScaleInputs) return avx512(x, w, y);
  // A row and its residual (exact activations) are added as 256 * row + residual before they are
  // converted, as the AVX512 tiles do, so both give the same bits.
  const int parts = x.quantized.parts == 2 && pairs_fit<Int4>(w) ? 2 : 1;
  tiles_and_edges(x, w, y, y_stride, [&](int tile_rows, int tile_groups) {
    // Scratch (kernel_scratch_bytes: 4 bytes per row and input, rows >= 32 here): the gathered
    // routed rows, then the two widened groups.
    const TileRows rows = quantized_tile_rows(x, tile_rows, w.k);
    uint8_t* widened = x.scratch + round_up(rows.scratch_bytes, size_t(kLineBytes));
    const size_t widened_group_bytes = size_t(w.k) * kGroupRows;
    alignas(64) int32_t sums[kBlockRows][kBlockOutputs];
    alignas(64) float acc[kBlockRows][kBlockOutputs];
    for (int g = 0; g < tile_groups; g += kBlockGroups) {
      for (int h = 0; h < kBlockGroups; ++h)
        widen_group(w.values + (g + h) * w.group_bytes, w.k, widened + h * widened_group_bytes);
      for (int i = 0; i < tile_rows; i += kBlockRows) {
        std::fill(&acc[0][0], &acc[0][0] + kBlockRows * kBlockOutputs, 0.0f);
        for (int s = 0; s < w.k / per_scale; ++s) {
          tile_sums(rows.values + size_t(i) * rows.stride, rows.stride, widened, widened + widened_group_bytes,
                    s * per_scale, per_scale, &sums[0][0]);
          V::Float scale[kBlockGroups];
          V::Int zero_points[kBlockGroups];
          for (int h = 0; h < kBlockGroups; ++h) {
            scale[h] = Int4::scale(w, w.scales + (g + h) * w.group_scale_bytes, s, 0);
            zero_points[h] = w.zeros != nullptr
                                 ? V::load(w.zeros + (g + h) * w.group_zero_bytes + size_t(s) * kGroupRows * 4)
                                 : V::set1(Int4::kOffset);
          }
          // Row r's sums minus the zero points times its activations' sum.
          const auto row_sum = [&](int r, int h) {
            const V::Int x_sum = V::set1(quantized_sum(x.quantized_row(i + r), s * per_scale, per_scale));
            return V::sub_epi32(_mm512_load_si512(&sums[r][h * kGroupRows]), V::mullo_epi32(zero_points[h], x_sum));
          };
          for (int r = 0; r < kBlockRows; r += parts)
            for (int h = 0; h < kBlockGroups; ++h) {
              V::Int sum = row_sum(r, h);
              if (parts == 2) sum = V::add_epi32(V::slli_epi32(sum, 8), row_sum(r + 1, h));
              V::storeu_ps(&acc[r][h * kGroupRows],
                           V::fmadd(V::to_float(sum), scale[h], V::loadu_ps(&acc[r][h * kGroupRows])));
            }
        }
        for (int r = 0; r < kBlockRows; r += parts) {
          // The sums are in steps of the last part's scale (the residual's: the row's / 256).
          const V::Float x_scale = V::set1_ps(x.quantized_row(i + r + parts - 1).scale);
          for (int h = 0; h < kBlockGroups; ++h) {
            float* out = y + size_t(i + r) * y_stride + (g + h) * kGroupRows;
            V::storeu_ps(out, V::mul(V::loadu_ps(&acc[r][h * kGroupRows]), x_scale));
            if (parts == 2) V::storeu_ps(out + y_stride, V::set1_ps(0.0f));
          }
        }
      }
    }
  }, avx512);
}

}  // namespace amx
KT_NAMESPACE_END
