// The kernel interface: declared once here, defined once per kernels_<isa>/ directory (its
// entry.cpp). A variant module links src/core with one kernels directory (the amx build: with the
// avx512 one below it), so the choice of implementation is made by the linker and, inside a build,
// once at start-up by init_kernels(), not by branches in hot loops.
//
// Adding a weight format:
//   1. its packed layout and constants below, and a field in Kernels;
//   2. src/core/formats/<name>.cpp: pack, unpack and the FormatTraits entry, and one line in the
//      table of src/core/formats.cpp;
//   3. one GEMM per kernels directory (the shared tiles in kernels_common/ usually do the work),
//      put in the table by its entry.cpp;
//   4. one entry in the Python registry (src/kt_kernel/formats.py): names, canonical tensors,
//      quantize / dequantize, checkpoint tensors;
//   5. test rows: the format's name in the tests' format lists.
#pragma once

#include "common.h"

KT_NAMESPACE_BEGIN

// Every format stores a weight matrix W[rows][k] (rows = outputs) in groups of kGroupRows rows,
// padded with zero rows; a kernel call covers a run of consecutive groups.
constexpr int kGroupRows = 16;

inline int packed_groups(int rows) { return ceil_div(rows, kGroupRows); }

// Activation rows quantized for the kernels that multiply in integers (the formats whose
// FormatTraits::quantized_activations() holds), one scale per row:
//   x[k] ~= scale * values[k], values in [-127, 127], zero padded to a multiple of kActivationBlock;
// running_sums[b] = sum of values[0 .. 16b), b = 0 .. stride / 16 (the kernels subtract their weight
// offset times a scale group's sum: one subtraction, where a sum of its blocks was a loop per row
// and group; 16: the smallest scale group, GGUF's K-quants). Even 256 x a row's + its residual's fits int32: 257 x 127 x kInt8MaxK < 2^31.
// By default each activation row is held by TWO such rows (parts): the row, and what it leaves
// (x - scale * values, at most half a step) at 1/256 of its scale. The GEMMs multiply both like
// any two rows (the 4-bit tiles add their integer sums as 256 * row + residual; without vpdpbusd
// the two are multiplied as the one int16 row 256 q + r: int_tiles.h) and the engine adds their
// outputs: x is then held to about 1/65000 of its largest magnitude, so a few outlier channels no
// longer round the rest of the row away.
constexpr int kActivationBlock = 32;
constexpr int kSumBlock = 16;
constexpr float kResidualSteps = 256.0f;
inline size_t running_sums_per_row(size_t stride) { return stride / kSumBlock + 1; }
struct QuantizedRows {
  const int8_t* values = nullptr;  // [row][stride]
  const float* scales = nullptr;   // [row]
  const int32_t* running_sums = nullptr;  // [row][running_sums_per_row(stride)]
  size_t stride = 0;
  int parts = 1;  // 2: rows 2t, 2t + 1 are a row and its residual
};

// One quantized row, as the integer tiles take it.
struct QuantizedRow {
  const int8_t* values;
  const int32_t* running_sums;
  float scale;
};

// Where quantize_activation_row writes one row: values [stride], its scale, running sums
// [running_sums_per_row(stride)].
struct QuantizedRowOut {
  int8_t* values;
  float* scale;
  int32_t* running_sums;
};

// x (bf16, k values) -> one quantized row, and with `residual` also the row of what it leaves.
void quantize_activation_row(const bf16_t* x, int k, int stride, QuantizedRowOut row,
                             const QuantizedRowOut* residual = nullptr);

// The activation rows a GEMM reads: row i is base + (row_ids ? row_ids[i] : i) * stride, bf16,
// readable (zero padded) up to round_up(k, 2) elements; for the formats multiplied in integers
// (FormatTraits::quantized_activations()) also `quantized`, indexed the same way.
// scratch: kernel_scratch_bytes(rows, k) bytes, sized by the caller before the job starts, for a
// kernel that widens or gathers its rows first.
constexpr int kPaddedRows = 32;
// Row strides of the engine's activation buffers are this many bytes over a multiple of 64: rows a
// multiple of 4 KiB apart would put the 16 rows of a tile load into one L1 set.
constexpr size_t kRowPadBytes = 64;
struct Activations {
  const bf16_t* base;
  size_t stride;
  const int32_t* row_ids;
  int rows;
  QuantizedRows quantized = {};
  uint8_t* scratch = nullptr;
  // With row_ids null: the rows after the last, up to the next multiple of kPaddedRows (bf16 rows,
  // and quantized rows), may be read too. A tile kernel then takes the rows in place; what it
  // computes from the extra rows is dropped.
  bool padded_rows = false;
  size_t index(int i) const { return size_t(row_ids ? row_ids[i] : i); }
  const bf16_t* row(int i) const { return base + index(i) * stride; }
  QuantizedRow quantized_row(int i) const {
    const size_t r = index(i);
    return {quantized.values + r * quantized.stride,
            quantized.running_sums + r * running_sums_per_row(quantized.stride), quantized.scales[r]};
  }
};

inline size_t kernel_scratch_bytes(int rows, int k) {
  return size_t(round_up(rows, 32)) * (round_up(k, 4) * sizeof(float) + 1024) + 32768;
}

// Scale groups in a row of k inputs, one per scale_group inputs (0: the row is one group).
inline int scale_groups_per_row(int k, int scale_group) { return scale_group > 0 ? k / scale_group : 1; }

// A run of packed groups of one matrix.
struct PackedGroups {
  const uint8_t* values;     // the first group's weights
  const uint8_t* scales;     // the first group's scales (formats that have them)
  size_t group_bytes;        // stride between groups in `values`
  size_t group_scale_bytes;  // stride between groups in `scales`
  int k;                     // inputs per row
  int groups;
  int scale_group = 0;       // inputs per scale: one of the format's FormatTraits::scale_groups (0: per row)
  // INT4 with zero points: the first group's (null: every zero point is kInt4Offset) and the
  // stride between groups.
  const uint8_t* zeros = nullptr;
  size_t group_zero_bytes = 0;
  // GGUF held as 4-bit indices: the 16 levels they index, each + 128 (u8; 16-byte aligned); else null.
  const int8_t* levels = nullptr;
  // GGUF's values in 2, 3, 5 or 6 bits (value planes, below) and the byte added to each (the lowest
  // value + 128); 8 in the other layouts.
  int value_bits = 8;
  uint8_t value_offset = 0;
  // GGUF's scales factored, and whether it holds mins (above); fp16 unfactored entries, fp16 factors,
  // and the bits of a factored multiple (8, or 6: stored + multiple_bias, 0 or 32).
  bool factored_scales = false, mins = true, half_scales = false, half_factors = false;
  uint8_t multiple_bits = 8, multiple_bias = 0;
  // Factored: where a group's multiples and factors start (gguf_multiples_offset, gguf_factors_offset),
  // set once with the groups: the kernels would divide by the scale group for them per scale group.
  uint32_t multiples_at = 0, factors_at = 0;
  // GGUF's scales as unsigned E4M3 bytes (NVFP4's own), and the matrix's fp32 factor: every output
  // is multiplied by it (1 in the other layouts).
  bool e4m3_scales = false;
  float scale_factor = 1.0f;
  // The weights the caller multiplies next (as many groups, the same k and format), or null: the
  // tiles' prefetches run on into them (gemm_tiled).
  const uint8_t* next_values = nullptr;
  // Set by gemm_tiled, read by prefetch_weights (gemm_tiles.h): prefetch each line 4 KiB ahead into
  // L1, or into L2: 4 KiB ahead up to far_from bytes into its group, far_distance bytes on after.
  bool prefetch_to_l1 = true;
  size_t far_from = 0;
  ptrdiff_t far_distance = 0;
};

// ---- BF16 -----------------------------------------------------------------------------------
// Inside a group, for each input pair (2p, 2p+1) the 16 rows' two values lie side by side:
//   pair p, row r -> { W[r][2p], W[r][2p + 1] }
// so one 64-byte line holds 16 rows x 2 inputs: one vdpbf16ps operand, or two AVX2 fp32 vectors
// after a shift / mask. k is padded to an even count with zeros.

// ---- MXFP4 (OCP Microscaling: E2M1 values, one E8M0 scale per 32 inputs) --------------------
// Canonical input: codes [rows][k/2] (low nibble = even k), scales [rows][k/32]; k % 32 == 0.
// Packed: per group, per 32-input block, four 64-byte chunks; chunk c holds inputs 8c..8c+7 of the
// 16 rows as one 32-bit word per row (row r at bytes 4r..4r+3) with the code of input 2j in bits
// 4(j%4)..+3 and the code of input 2j+1 sixteen bits higher (j = 4c..4c+3). So a word's low
// nibbles hold inputs {0, 4, 1, 5} of the octet and its high nibbles {2, 6, 3, 7}: one mask (and a
// shift) yields two quads of codes for the 4-bit integer tiles, which look the codes up as integers
// (twice an E2M1 value is an integer). MXFP4's quantized activations are stored in that order
// (order_octets_for_mxfp4, once per row at quantization), so the tiles read the words as they are.
// Scales: per group, per block, 16 bytes (one per row).
constexpr int kMxfp4Block = 32;
// Puts each octet of a quantized activation row (count % 8 == 0) in the packed MXFP4 words' nibble
// order: inputs {0, 4, 1, 5, 2, 6, 3, 7}. The order stays inside each 32-input block, so the
// running sums hold.
void order_octets_for_mxfp4(int8_t* values, int count);
constexpr int kMxfp4ChunkBytes = 64;

// ---- INT8 and INT4: integer dot products with int8 activations (QuantizedRows) --------------
// Weights are stored UNSIGNED, INT8 as q + 128 and INT4 as q + 8, so that one u8 x s8 dot product
// serves every ISA (vpdpbusd, AMX tdpbsud, vpmaddwd / vpmaddubsw); the kernels subtract the offset
// times the activations' sums (running_sums). Sums stay exact in int32 (INT8 needs k <= kInt8MaxK).
// INT8: per group, per input quad j (inputs 4j..4j+3), one 64-byte line: row r at bytes 4r..4r+3
// (zero weights pad k to a multiple of 4; zero activations make the padding harmless). Scales: per
// group 16 floats, y = x_scale * row_scale * (dot - 128 * sum(x)).
// INT4: per group, per input octet c (inputs 8c..8c+7), one 64-byte line: row r's 32-bit word holds
// inputs 8c..8c+3 in the low nibbles of its bytes and 8c+4..8c+7 in the high nibbles, so one mask
// (and a shift) yields two INT8-layout quads. Scales: per group, per G inputs, 16 floats.
// INT4 zero points (asymmetric checkpoints, GPTQ): the canonical offset z' (int8, -8..8) of a row's
// G inputs makes its weights (q - z') * s; packed as the zero point z' + 8 of the stored nibbles,
// per group, per G inputs, 16 int32, which the kernels subtract times the activations' sums
// instead of 8.
constexpr int kInt8Offset = 128, kInt4Offset = 8;

// ---- GGUF (llama.cpp's integer block types, held as int8 values with a scale and a min per group)
// Every weight is q * scale + min, q an int8, scale and min fp32 per G = 16 or 32 inputs of a row
// (kt_kernel/gguf_blocks.py turns each ggml type into that exactly). How a projection is held is
// chosen by its data at load (HeldLayout, formats.h), always exactly (bit for bit, as the kernels
// compute each scale and min):
// Values: the INT8 layout above (q + 128); or, where every value of the projection is one of 16
// levels (the 4-bit and smaller ggml types), 4-bit indices into them in the INT4 layout, the levels
// + 128 in PackedGroups::levels; or, where every value lies in [lowest, lowest + 2^b), value planes
// of b bits (PackedGroups::value_bits b, value_offset lowest + 128): b = 2 or 3 where the values
// span at most 4 or 8 integers (Q2_K, Q3_K; ahead of the levels), else b = 6, or b = 5 where the
// scale group is a multiple of 32 (Q6_K, Q5_K, Q5_0, Q5_1). A value v = q - lowest is held as its
// low bits (b = 5, 6: 4, the INT4 layout's nibbles; b = 2, 3: 2, crumbs) and its h = b - 4 or b - 2
// high bits in a plane. Per group, per unit (6 bits: 16 inputs; else 32), its low lines (4 / h
// nibble lines, or 2 crumb lines) then, where h > 0, one plane line, 64 bytes each: b bits per
// weight. Quad q of a unit (inputs 4q..4q+3 in bytes 0..3 of each row's word, row r at bytes
// 4r..4r+3): low bits in nibble line q / 2 at bit 4 (q % 2) of each byte, or in crumb line q / 4 at
// bit 2 (q % 4); high bits in the plane line at bits p..p+h-1 of the byte, p = h q. Shifted into
// place, masked and or-ed, they make the bytes v of an INT8-layout quad; the kernels multiply v as
// it is and start each scale group's sum at lowest * sum(x), not -128 * sum(x).
// Scales and mins: each entry is 16 rows' scales or 16 rows' mins (row r the r-th value). The
// kernels start a scale group's integer sum at -128 * sum(x), the offset, and multiply the min
// entry by that start times -1/128 (sum(x), exact: a power of two): one fp32 FMA. Where every min
// is 0 (PackedGroups::mins false), the min entries are left out. Per group, with no padding unless
// said (aligned loads only for fp32 entries and for fp32 factors before int8 multiples):
//   unfactored: per scale group s, a scale entry then a min entry, as fp32, or as fp16 where every
//   scale and min of the projection is one (PackedGroups::half_scales).
//   factored (PackedGroups::factored_scales; the K-quants' own form): every scale of a row's
//   kGgufBlockInputs inputs is an integer multiple of one factor (exactly: found and checked at
//   load), and so is every min; scale = multiple * factor. The factors are fp32, or fp16 where
//   every one is (half_factors); the multiples int8 (multiple_bits 8), or, where every multiple of
//   the projection is in 0..15 (Q2_K's), 4 bits (multiple_bits 4: row r at bits 4r..4r+3 of the
//   entry's 8 bytes), or where each is in 0..63 (Q4_K's, Q5_K's) or -32..31 (IQ4_XS's, Q3_K's), 6
//   bits (multiple_bits 6): multiple + multiple_bias (0 or 32), row r at bits 6r..6r+5 of the
//   entry's 12 bytes (little-endian). Two orders:
//     fp32 factors and int8 multiples: first, per block of kGgufBlockInputs inputs, the fp32
//     entries of those factors; then, per scale group s, the entries of int8 multiples; the group
//     padded to whole 64-byte lines (aligned factors);
//     the others: first, per scale group s, the entries of multiples; then, per block, the entries
//     of factors (so that the kernels' 6-bit reads, up to 4 bytes past an entry, stay in the group).
//   E4M3 (PackedGroups::e4m3_scales; NVFP4's form, no mins): every scale of the matrix is an
//   unsigned E4M3 value times one fp32 factor per matrix (exactly: found and checked at load), held
//   as that byte: per scale group s, 16 bytes, one per row, and the factor in
//   PackedGroups::scale_factor (PackedProjection::factors), applied to the outputs: the file's bytes.
// So per 256 inputs of a row: Q4_0, IQ4_NL 128 + 16 bytes, Q8_0 256 + 16, Q4_1 128 + 32 (fp16
// entries); Q4_K 128 + 12 + 4, Q5_K 256 + 12 + 4, IQ4_XS 128 + 6 + 2 (6-bit multiples, fp16
// factors); Q6_K 256 + 16 + 2 (int8 multiples, fp16 factors); Q3_K 96 + 12 + 2 (3-bit planes, 6-bit
// multiples); Q2_K 64 + 16 + 4 (2-bit planes, 4-bit multiples): no more than the file's.
constexpr int kLevels = 16;
constexpr int kGgufBlockInputs = 256;
inline size_t indexed_group_bytes(int k) { return size_t(k / 2) * kGroupRows; }
// Value planes of `bits` (2, 3, 5 or 6) bits: a value's low bits (nibbles or crumbs) and high bits, a
// unit's low lines, all its lines (the plane line last, where there are high bits) and its inputs.
constexpr int plane_low_bits(int bits) { return bits > 4 ? 4 : 2; }
constexpr int plane_high_bits(int bits) { return bits - plane_low_bits(bits); }
constexpr int plane_lines(int bits) { return bits > 4 ? 4 / plane_high_bits(bits) : 2; }
constexpr int unit_lines(int bits) { return plane_lines(bits) + (plane_high_bits(bits) > 0 ? 1 : 0); }
constexpr int unit_inputs(int bits) { return plane_lines(bits) * 32 / plane_low_bits(bits); }
inline size_t planar_group_bytes(int k, int bits) { return size_t(k) * bits / 8 * kGroupRows; }
// Entries per scale group: a scale, and a min unless they are left out.
constexpr int gguf_entries(bool mins) { return mins ? 2 : 1; }
// Where scale group s's entry (0: its scales, 1: its mins) starts in one group's packed scales, in
// values (fp32 or fp16; factored: multiples, past gguf_multiples_offset).
inline int gguf_entry_index(int s, int entry, bool mins) { return (s * gguf_entries(mins) + entry) * kGroupRows; }
// Factored: the index of the factors of scale group s's entry (past gguf_factors_offset).
inline int gguf_factor_index(int s, int entry, int scale_group, bool mins) {
  return gguf_entry_index(s * scale_group / kGgufBlockInputs, entry, mins);
}
// The layout of a group's scales, of anything with PackedGroups' fields (PackedGroups, HeldLayout).
// Factored with fp32 factors and int8 multiples: factors first, in whole lines.
template <class L>
bool gguf_factors_first(const L& l) {
  return !l.half_factors && l.multiple_bits == 8;
}
inline size_t gguf_factor_bytes(int k, bool mins, bool half) {
  return size_t(ceil_div(k, kGgufBlockInputs)) * gguf_entries(mins) * kGroupRows * (half ? 2 : 4);
}
inline size_t gguf_multiple_bytes(int k, int scale_group, bool mins, int bits) {
  return size_t(k / scale_group) * gguf_entries(mins) * kGroupRows * bits / 8;
}
template <class L>
size_t gguf_multiples_offset(const L& l, int k) {
  return gguf_factors_first(l) ? gguf_factor_bytes(k, l.mins, false) : 0;
}
template <class L>
size_t gguf_factors_offset(const L& l, int k, int scale_group) {
  return gguf_factors_first(l) ? 0 : gguf_multiple_bytes(k, scale_group, l.mins, l.multiple_bits);
}
template <class L>
size_t gguf_group_scale_bytes(const L& l, int k, int scale_group) {
  const size_t entries = size_t(k / scale_group) * gguf_entries(l.mins) * kGroupRows;
  if (!l.factored_scales) return entries * (l.half_scales ? 2 : 4);
  const size_t bytes = gguf_factor_bytes(k, l.mins, l.half_factors) +
                       gguf_multiple_bytes(k, scale_group, l.mins, l.multiple_bits);
  return gguf_factors_first(l) ? size_t(round_up(int(bytes), 64)) : bytes;
}
// E4M3 scales: a byte per row and scale group, no padding (held <= NVFP4's file bytes).
inline size_t gguf_e4m3_scale_bytes(int k, int scale_group) { return size_t(k / scale_group) * kGroupRows; }
constexpr int kInt8MaxK = 65536;  // 65536 * 255 * 127 < 2^31

// ---- FP8 (E4M3, OCP "fn"): bf16 activations, weights decoded to bf16 in the kernel --------
// Canonical input: codes [rows][k] uint8, float scales [rows][1] (per channel), [rows][k/16] (one
// per 16 inputs: NVFP4's blocks, its codes widened to E4M3), [rows][k/32] (MXFP8's blocks, its E8M0
// scales as floats) or [rows][k/128] (one per 128 inputs of a row: DeepSeek's 128 x 128 blocks,
// expanded along the rows).
// Packed: per group, per input pair p, 32 bytes: row r's codes of inputs 2p, 2p+1 at bytes 2r, 2r+1
// (zero codes pad k to even), so decoding a group byte by byte gives the BF16 layout above. Every
// E4M3 value is exact in bf16, so the BF16 GEMM of the decoded weights is exact up to the scales,
// which the kernel applies per block in fp32. Scales: per group, per block (one block when per
// channel), 16 floats; then the group's small-code bitmap: bit p % 64 of 64-bit word p / 64 is set
// where input pair p holds a zero or subnormal code (exponent field 0). Kernels that decode every
// code as a normal one (the AVX2 build's) take their exact decoder for those pairs alone, without
// testing each pair's codes (about one code in 10^4 of real weights is such a code).
constexpr int kFp8Block = 128;
constexpr int kMxfp8Block = 32, kNvfp4Block = 16;
inline size_t fp8_scale_bytes(int k, int scale_group) {
  return size_t(scale_groups_per_row(k, scale_group)) * kGroupRows * sizeof(float);
}
// Whole 64-byte lines, so that the next group's scales stay aligned.
inline int fp8_small_code_words(int k) { return round_up(ceil_div(ceil_div(k, 2), 64), 8); }
inline const uint64_t* fp8_small_codes(const PackedGroups& w, int group) {
  return reinterpret_cast<const uint64_t*>(w.scales + size_t(group) * w.group_scale_bytes +
                                           fp8_scale_bytes(w.k, w.scale_group));
}

// ---- GEMM: y[i][j] = sum_k x_i[k] * W[j][k], i < x.rows, j < kGroupRows * w.groups ----------
// fp32 accumulation; y is overwritten, row stride y_stride floats. The integer formats read
// x.quantized. A GEMM may use x.scratch and allocates nothing: it runs inside pool jobs, which must
// not throw.
using GemmFn = void (*)(const Activations& x, const PackedGroups& w, float* y, size_t y_stride);

// ---- Machine-limit probes (for the benchmark) -------------------------------------------------
enum class PeakOp { kFmaF32, kDpBf16, kDpInt8, kTileBf16 };  // fp32 FMA, vdpbf16ps, vpdpbusd, AMX tdpbf16ps
// Runs `iterations` rounds of independent multiply-adds of kind `op` on the calling thread and
// returns the flops done (0 when this build or CPU cannot execute `op`).
using PeakFn = double (*)(PeakOp op, int64_t iterations);

// The build's GEMM per format and its peak probes, chosen once by init_kernels() (entry.cpp of each
// kernels directory; the amx build's table is the avx512 one with tiles put in). Filled by field
// name ({.bf16 = ...}); the module refuses to load where a registered format's field is null
// (require_kernels_for_every_format, formats.h).
struct Kernels {
  GemmFn bf16 = nullptr, mxfp4 = nullptr, int8 = nullptr, int4 = nullptr, fp8 = nullptr, gguf = nullptr;
  PeakFn peak = nullptr;
};
const Kernels& kernels();
inline double peak_probe(PeakOp op, int64_t iterations) { return kernels().peak(op, iterations); }

// ---- Start-up ------------------------------------------------------------------------------------
// Picks the finer paths of this build (e.g. AVX512_BF16 or plain AVX512F) from CPUID, once.
void init_kernels();

// How each kernel of the table computes, in words (FormatTraits::path names a format's); every path
// is set, by field name, where two formats share a kernel too.
struct KernelInfo {
  const char* isa = nullptr;         // the build: avx2, avx512 or amx
  const char* bf16_path = nullptr;   // how bf16 products are computed (BF16 kernels)
  const char* mxfp4_path = nullptr;  // how MXFP4 weights are multiplied
  const char* int8_path = nullptr;   // how the INT8 and INT4 kernels multiply
  const char* fp8_path = nullptr;    // how FP8 codes are decoded and multiplied
  const char* gguf_path = nullptr;   // how GGUF's int8 values are multiplied
  long emulated_tile_products = -1;  // the test-only emulated AMX build: tile products run so far
};
KernelInfo kernel_info();

KT_NAMESPACE_END
