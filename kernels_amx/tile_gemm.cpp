// The amx build's tile GEMMs. On AMX-BF16 tiles (tdpbf16ps) for BF16, MXFP4, FP8 and INT4 weights:
// the weights of two groups are decoded to the BF16 tile layout (kernels.h) a chunk of inputs at a
// time into L1 and multiplied by the activations as bf16 (the tokens as given; the intermediate rows
// as SwiGLU rounds them, for every format), so the result is the exact product up to fp32
// accumulation. On AMX-INT8 tiles (tdpbsud) for INT8: its packed lines times the quantized rows.
//   BF16: the packed weights are the tiles' B operand as they are.
//   MXFP4: an E2M1 code times its E8M0 scale is a bf16 (scales 2^-125 .. 2^125), decoded exactly.
//   FP8: an E4M3 code is a bf16; its float scale (per row and block of inputs, or per row) is
//        applied to the fp32 sums of each block.
//   INT4 (no zero points, groups of 64 or 128): q is a bf16; its group's scale as FP8's.
// The quantized formats run here in their exact mode only (the int8_activations mode keeps its
// int8 kernels). Every row of a call runs on the tiles (the last block padded with zero rows), so an
// expert with 40 rows does not send 8 of them through the AVX512 kernel.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels_avx512/vec.h"
#include "tiles.h"

KT_NAMESPACE_BEGIN
namespace amx {
namespace {

constexpr int kBlockOutputs = kBlockGroups * kGroupRows;
constexpr int kLineBytes = kTileBytes;      // one B-tile row: one input pair of 16 outputs
// Inputs decoded at a time: two groups x 256 inputs of bf16 = 16 KiB, read back from L1 by the tile
// loads of every row block.
constexpr int kChunkInputs = 256;
constexpr size_t kChunkBytes = size_t(kChunkInputs) / 2 * kLineBytes;  // one group's decoded chunk

// ---- The activations: the A tiles' rows, one stride apart, readable up to a multiple of
// kBlockRows: in place where the caller padded them (Activations::padded_rows), else gathered once
// per call into the scratch and padded with zero rows. ----

struct GatheredRows {
  const uint8_t* values;
  size_t stride;  // bytes
  int rows, padded_rows;
  int parts;  // output row of gathered row r: r * parts (a quantized format's token keeps its rows)
  size_t scratch_bytes;  // of x.scratch taken by the gathered rows
};
static_assert(kPaddedRows % kBlockRows == 0);

GatheredRows in_place(const void* values, size_t stride, int rows, int parts) {
  return {static_cast<const uint8_t*>(values), stride, rows, round_up(rows, kBlockRows), parts, 0};
}

// Copies row i = 0 .. padded - 1 from row_of(i) (bytes bytes; zeros from `rows` on).
template <class RowOf>
GatheredRows gather(uint8_t* scratch, int rows, size_t bytes, int parts, RowOf row_of) {
  const int padded = round_up(rows, kBlockRows);
  const size_t stride = bytes + kRowPadBytes;
  for (int i = 0; i < padded; ++i) {
    uint8_t* dst = scratch + size_t(i) * stride;
    if (i < rows)
      std::memcpy(dst, row_of(i), bytes);
    else
      std::memset(dst, 0, bytes);
  }
  return {scratch, stride, rows, padded, parts, round_up(size_t(padded) * stride, size_t(64))};
}

// The tokens' bf16 rows for tdpbf16ps: a quantized format's x has `parts` rows per token (kernels.h),
// whose bf16 row the tiles take once.
struct Bf16Rows {
  static constexpr size_t kElementBytes = sizeof(bf16_t);
  static constexpr int kStepInputs = kTileBytes / kElementBytes;  // inputs per tile product: 16 pairs
  static GatheredRows gather_rows(const Activations& x, int k, uint8_t* scratch) {
    const int parts = x.quantized.values != nullptr ? x.quantized.parts : 1;
    if (x.row_ids == nullptr && x.padded_rows) return in_place(x.base, x.stride * kElementBytes, x.rows / parts, parts);
    return gather(scratch, x.rows / parts, size_t(k) * kElementBytes, parts,
                  [&](int i) { return x.base + x.index(i * parts) / parts * x.stride; });
  }
  static void dots() { block_dots_bf16(); }
};

// The quantized rows (every part) for tdpbsud.
struct Int8Rows {
  static constexpr size_t kElementBytes = 1;
  static constexpr int kStepInputs = kTileBytes;  // 16 quads
  static GatheredRows gather_rows(const Activations& x, int k, uint8_t* scratch) {
    if (x.row_ids == nullptr && x.padded_rows) return in_place(x.quantized.values, x.quantized.stride, x.rows, 1);
    return gather(scratch, x.rows, size_t(k), 1, [&](int i) { return x.quantized_row(i).values; });
  }
  static void dots() { block_dots_s8u8(); }
};

// ---- Weight formats, each: Rows (the activations their tiles take), kGroupBytesPerInput (packed
// bytes per input of a group: packed_at), chunk_inputs(w) (inputs per scaling step, a multiple of
// 32 or, INT8, 64), lines(w, group, k0, count, buffer) (the B-tile lines of inputs [k0, k0 + count)
// of the group: decoded into buffer, or in place), scales(w, group, k0) (16 floats to multiply the
// chunk's sums by, or null). ----

// Input k0 of a group of `Weights` in the packed layout.
template <class Weights>
const uint8_t* packed_at(const PackedGroups& w, int group, int k0) {
  return w.values + size_t(group) * w.group_bytes + size_t(k0) * Weights::kGroupBytesPerInput;
}

struct Bf16Weights {
  using Rows = Bf16Rows;
  static constexpr int kGroupBytesPerInput = 32;
  static int chunk_inputs(const PackedGroups&) { return kChunkInputs; }
  // Read in place. The driver prefetches the next pair's lines into L2 (next_pair); prefetching
  // each line 4 KiB ahead into L1 instead made qwen3-30b T = 512 on the 2-core AMX VM 68-75 -> 87 ms.
  static const uint8_t* lines(const PackedGroups& w, int group, int k0, int, uint8_t*) {
    return packed_at<Bf16Weights>(w, group, k0);
  }
  static const float* scales(const PackedGroups&, int, int) { return nullptr; }
};

// E2M1 code (sign in bit 3) -> bf16 bits; the upper half of the table is unused.
alignas(64) constexpr uint16_t kE2m1Bf16[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
// An E8M0 scale s gives bf16 values 2^(s - 127) x (0.5 .. 6): normal up to s = 252 (above, the
// AVX512 kernel takes the matrix); below s = 2 they would be denormals, which tdpbf16ps reads as
// zero anyway, so those weights (at most 6 x 2^-126) are decoded as zeros.
constexpr int kMinNormalE8M0 = 2, kMaxNormalE8M0 = 252;

struct Mxfp4Weights {
  using Rows = Bf16Rows;
  static constexpr int kGroupBytesPerInput = 8;
  static int chunk_inputs(const PackedGroups&) { return kChunkInputs; }
  static const uint8_t* lines(const PackedGroups& w, int group, int k0, int count, uint8_t* buffer) {
    const uint8_t* values = packed_at<Mxfp4Weights>(w, group, k0);
    const uint8_t* scales = w.scales + size_t(group) * w.group_scale_bytes + size_t(k0 / kMxfp4Block) * kGroupRows;
    const __m512i table = _mm512_load_si512(kE2m1Bf16);
    const __m512i code_pair = _mm512_set1_epi32(0x000F000F), magnitude = _mm512_set1_epi16(0x7);
    uint8_t* out = buffer;
    for (int b = 0; b < count / kMxfp4Block; ++b, values += 4 * kMxfp4ChunkBytes) {
      // Row r's scale as an addend to the bf16 exponent, in both halves of its 32-bit lane.
      __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kGroupRows)));
      scale = _mm512_or_si512(scale, _mm512_slli_epi32(scale, 16));
      const __m512i exponent = _mm512_slli_epi16(_mm512_sub_epi16(scale, _mm512_set1_epi16(127)), 7);
      const __mmask32 normal = _mm512_cmpge_epu16_mask(scale, _mm512_set1_epi16(kMinNormalE8M0));
      for (int c = 0; c < 4; ++c) {
        const __m512i words = _mm512_load_si512(values + c * kMxfp4ChunkBytes);
        // Pair j of the chunk (inputs 8c + 2j, 8c + 2j + 1): nibble j of each 16-bit half.
        for (int j = 0; j < 4; ++j, out += kLineBytes) {
          const __m512i codes = _mm512_and_si512(_mm512_srli_epi32(words, 4 * j), code_pair);
          const __m512i value = _mm512_permutexvar_epi16(codes, table);
          // Zero codes and flushed scales give 0.
          _mm512_store_si512(out, _mm512_maskz_add_epi16(_mm512_mask_test_epi16_mask(normal, codes, magnitude), value, exponent));
        }
      }
    }
    return buffer;
  }
  static const float* scales(const PackedGroups&, int, int) { return nullptr; }
  // No scale above kMaxNormalE8M0.
  static bool decodable(const PackedGroups& w) {
    const __m512i limit = _mm512_set1_epi8(char(kMaxNormalE8M0));
    const size_t bytes = size_t(w.groups) * w.group_scale_bytes;
    for (size_t i = 0; i < bytes; i += 64) {
      const __mmask64 valid = bytes - i >= 64 ? ~__mmask64(0) : (__mmask64(1) << (bytes - i)) - 1;
      if (_mm512_mask_cmpgt_epu8_mask(valid, _mm512_maskz_loadu_epi8(valid, w.scales + i), limit) != 0) return false;
    }
    return true;
  }
};

// INT4 nibble (q + 8) -> bf16 bits of q; the upper half of the table is unused.
alignas(64) constexpr uint16_t kInt4Bf16[32] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
                                                0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
// vpshufb controls: bytes 0, 1 (first) or 2, 3 (second) of each 32-bit lane to the low bytes of its
// two 16-bit halves, zeros above.
alignas(16) constexpr uint8_t kFirstPairs[16] = {0, 0x80, 1, 0x80, 4, 0x80, 5, 0x80, 8, 0x80, 9, 0x80, 12, 0x80, 13, 0x80};
alignas(16) constexpr uint8_t kSecondPairs[16] = {2,  0x80, 3,  0x80, 6,  0x80, 7,  0x80,
                                                  10, 0x80, 11, 0x80, 14, 0x80, 15, 0x80};

// Smaller INT4 groups take the INT8 tiles (gemm_four_bit.cpp): here each group's sums would be
// stored and scaled after every one or two tile steps.
constexpr int kMinBf16Int4Group = 64;

struct Int4Weights {
  using Rows = Bf16Rows;
  static constexpr int kGroupBytesPerInput = 8;
  static int chunk_inputs(const PackedGroups& w) { return w.scale_group; }
  static const uint8_t* lines(const PackedGroups& w, int group, int k0, int count, uint8_t* buffer) {
    const uint8_t* values = packed_at<Int4Weights>(w, group, k0);
    const __m512i table = _mm512_load_si512(kInt4Bf16), nibble = _mm512_set1_epi16(0xF);
    const __m512i first = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kFirstPairs)));
    const __m512i second = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kSecondPairs)));
    uint8_t* out = buffer;
    for (int c = 0; c < count / 8; ++c, values += kLineBytes) {
      const __m512i words = _mm512_load_si512(values);
      // Octet c: inputs 8c + {0, 1} (low nibbles of bytes 0, 1), {2, 3} (bytes 2, 3), then the
      // high nibbles for {4, 5} and {6, 7}.
      const __m512i pairs01 = _mm512_shuffle_epi8(words, first), pairs23 = _mm512_shuffle_epi8(words, second);
      const __m512i codes[4] = {_mm512_and_si512(pairs01, nibble), _mm512_and_si512(pairs23, nibble),
                                _mm512_and_si512(_mm512_srli_epi16(pairs01, 4), nibble),
                                _mm512_and_si512(_mm512_srli_epi16(pairs23, 4), nibble)};
      for (int j = 0; j < 4; ++j, out += kLineBytes) _mm512_store_si512(out, _mm512_permutexvar_epi16(codes[j], table));
    }
    return buffer;
  }
  static const float* scales(const PackedGroups& w, int group, int k0) {
    return reinterpret_cast<const float*>(w.scales + size_t(group) * w.group_scale_bytes) +
           size_t(k0 / w.scale_group) * kGroupRows;
  }
};

struct Fp8Weights {
  using Rows = Bf16Rows;
  static constexpr int kGroupBytesPerInput = 16;
  static int chunk_inputs(const PackedGroups& w) { return w.scale_group > 0 ? w.scale_group : kChunkInputs; }
  static const uint8_t* lines(const PackedGroups& w, int group, int k0, int count, uint8_t* buffer) {
    const uint8_t* codes = packed_at<Fp8Weights>(w, group, k0);
    for (size_t i = 0; i < size_t(count) * kGroupRows; i += 32)
      _mm512_store_si512(buffer + i * sizeof(bf16_t), avx512::decode_fp8_line<>(codes + i));
    return buffer;
  }
  static const float* scales(const PackedGroups& w, int group, int k0) {
    const int block = w.scale_group > 0 ? k0 / w.scale_group : 0;
    return reinterpret_cast<const float*>(w.scales + size_t(group) * w.group_scale_bytes) + block * kGroupRows;
  }
};

// INT8 (amx_int8 tiles, int8_activations or not): the packed layout is the tile's B operand (one
// 64-byte line per input quad); the int32 sums are corrected for the +128 weight offset and scaled
// per row at the end.
struct Int8Weights {
  using Rows = Int8Rows;
  static constexpr int kGroupBytesPerInput = 16;
  static int chunk_inputs(const PackedGroups&) { return 2 * kChunkInputs; }
  static const uint8_t* lines(const PackedGroups& w, int group, int k0, int, uint8_t*) {
    return packed_at<Int8Weights>(w, group, k0);
  }
  static const float* scales(const PackedGroups&, int, int) { return nullptr; }
};

// ---- The driver ----

// Groups are taken kSetGroups at a time, and for each chunk of inputs all their pairs: the
// activations' chunk (32 rows: 16 KiB) is then read from L1 or L2 once per pair, where a whole
// pass over k per pair read every row from L2 or L3 again (dsv3-32e, 128 rows of 7168 inputs).
constexpr int kSetGroups = 8;
constexpr int kSetOutputs = kSetGroups * kGroupRows;

// y for the set's groups from their sums (fp32, or INT8's int32).
template <class Weights>
void write_outputs(const Activations& x, const PackedGroups& w, const GatheredRows& a, int set, int set_groups,
                   const float* sums, float* y, size_t y_stride) {
  const int cols = set_groups * kGroupRows;
  for (int r = 0; r < a.rows; ++r) {
    float* out = y + size_t(r) * a.parts * y_stride + set * kGroupRows;
    const float* sum = sums + size_t(r) * kSetOutputs;
    if constexpr (std::is_same_v<typename Weights::Rows, Int8Rows>) {
      const QuantizedRow row = x.quantized_row(r);
      const int32_t offset = kInt8Offset * quantized_sum(row, 0, w.k);
      const float* scales = reinterpret_cast<const float*>(w.scales + size_t(set) * w.group_scale_bytes);
      const int32_t* integers = reinterpret_cast<const int32_t*>(sum);
      for (int c = 0; c < cols; ++c) out[c] = float(integers[c] - offset) * scales[c] * row.scale;
    } else {
      std::memcpy(out, sum, cols * sizeof(float));
      if (a.parts == 2) std::memset(out + y_stride, 0, cols * sizeof(float));
    }
  }
}

// The packed weights of the pair of groups after (set, g, k0) in the driver's order.
template <class Weights>
StreamPrefetch next_pair(const PackedGroups& w, int set, int g, int k0, int chunk) {
  const int set_groups = std::min(kSetGroups, w.groups - set);
  int group = set + g + kBlockGroups;
  if (g + kBlockGroups >= set_groups) {
    group = set;
    k0 += chunk;
    if (k0 >= w.k) group += kSetGroups, k0 = 0;
  }
  if (group >= w.groups) return {};
  return {packed_at<Weights>(w, group, k0), packed_at<Weights>(w, std::min(group + 1, w.groups - 1), k0)};
}

template <class Weights>
void gemm_on_tiles(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  using V = avx512::Vec;
  using Rows = typename Weights::Rows;
  // Scratch (kernel_scratch_bytes): the gathered rows, two decoded chunks, the sums of a set.
  const GatheredRows a = Rows::gather_rows(x, w.k, x.scratch);
  uint8_t* decoded = x.scratch + a.scratch_bytes;
  float* sums = reinterpret_cast<float*>(decoded + 2 * kChunkBytes);  // [padded rows][kSetOutputs]
  constexpr size_t kSumsBytes = kSetOutputs * sizeof(float);           // a row of sums
  alignas(64) float block[kBlockRows][kBlockOutputs];
  const int chunk = Weights::chunk_inputs(w);
  configure_tiles();
  for (int set = 0; set < w.groups; set += kSetGroups) {
    const int set_groups = std::min(kSetGroups, w.groups - set);
    for (int k0 = 0; k0 < w.k; k0 += chunk) {
      const int count = std::min(chunk, w.k - k0);
      for (int g = 0; g < set_groups; g += kBlockGroups) {
        const uint8_t* lines[kBlockGroups];
        const float* scales[kBlockGroups];
        for (int h = 0; h < kBlockGroups; ++h) {
          // A lone last group is multiplied twice (the second product is dropped): no zero tile needed.
          const int group = set + g + std::min(h, set_groups - g - 1);
          lines[h] = Weights::lines(w, group, k0, count, decoded + h * kChunkBytes);
          scales[h] = Weights::scales(w, group, k0);
        }
        // The next pair's weights are fetched into L2 while this pair's products run, spread over the
        // steps of all its row blocks.
        StreamPrefetch prefetch = next_pair<Weights>(w, set, g, k0, chunk);
        const int steps = count / Rows::kStepInputs;
        if (prefetch.b0 != nullptr)
          prefetch.per_step = round_up(size_t(Weights::kGroupBytesPerInput) * Rows::kStepInputs * kBlockRows / a.padded_rows,
                                       size_t(64));
        for (int i = 0; i < a.padded_rows; i += kBlockRows) {
          float* sum = sums + size_t(i) * kSetOutputs + g * kGroupRows;
          prefetch.first = size_t(i / kBlockRows) * steps * prefetch.per_step;
          if (scales[0] == nullptr && k0 > 0) {
            load_block(sum, kSumsBytes);
          } else {
            KT_TILE_ZERO(0);
            KT_TILE_ZERO(1);
            KT_TILE_ZERO(2);
            KT_TILE_ZERO(3);
          }
          add_block_product(a.values + size_t(i) * a.stride + k0 * Rows::kElementBytes, a.stride, lines[0], lines[1],
                            count * Rows::kElementBytes, Rows::dots, prefetch);
          if (scales[0] == nullptr) {
            store_block(sum, kSumsBytes);
            continue;
          }
          // Scaled per chunk: the chunk's sums times the scales, added in fp32.
          store_block(block, sizeof(block[0]));
          for (int r = 0; r < kBlockRows; ++r)
            for (int h = 0; h < kBlockGroups; ++h) {
              float* out = sum + size_t(r) * kSetOutputs + h * kGroupRows;
              const V::Float part = V::mul(V::load_ps(&block[r][h * kGroupRows]), V::loadu_ps(scales[h]));
              V::storeu_ps(out, k0 == 0 ? part : V::add_ps(part, V::loadu_ps(out)));
            }
        }
      }
    }
    write_outputs<Weights>(x, w, a, set, set_groups, sums, y, y_stride);
  }
  release_tiles();
}

// Calls of fewer rows (tokens: decode) take the AVX512 kernels, which stream the weights once
// through registers; from 16 rows on the tiles were faster for every format here (a 2-core Xeon VM
// with AMX, k = 2048, 16384 outputs: BF16 9.2 -> 5.7 ms, MXFP4 4.1 -> 2.8, FP8 9.8 -> 3.3 at 16 rows;
// at 8 rows BF16 and MXFP4 were slower on the tiles).
constexpr int kMinTileRows = 16;

// Rows per token of x: 2 where a quantized format's activations are exact (kernels.h).
int parts_of(const Activations& x) { return x.quantized.values != nullptr ? x.quantized.parts : 1; }

template <class Weights>
bool tiles_fit(const Activations& x, const PackedGroups& w) {
  return x.rows / parts_of(x) >= kMinTileRows && w.k % Weights::Rows::kStepInputs == 0;
}

}  // namespace

void gemm_bf16(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (!tiles_fit<Bf16Weights>(x, w)) return avx512::paths().bf16(x, w, y, y_stride);
  gemm_on_tiles<Bf16Weights>(x, w, y, y_stride);
}

void gemm_mxfp4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (!tiles_fit<Mxfp4Weights>(x, w) || parts_of(x) != 2 || !Mxfp4Weights::decodable(w)) return avx512::paths().mxfp4(x, w, y, y_stride);
  gemm_on_tiles<Mxfp4Weights>(x, w, y, y_stride);
}

void gemm_fp8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  // A tile step takes 32 inputs: blocks of 16 (NVFP4's) take the AVX512 kernel.
  if (!tiles_fit<Fp8Weights>(x, w) || w.scale_group % Bf16Rows::kStepInputs)
    return avx512::paths().fp8(x, w, y, y_stride);
  gemm_on_tiles<Fp8Weights>(x, w, y, y_stride);
}

void gemm_int4(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (!tiles_fit<Int4Weights>(x, w) || parts_of(x) != 2 || w.zeros != nullptr || w.scale_group < kMinBf16Int4Group)
    return gemm_int4_on_int8_tiles(x, w, y, y_stride);
  gemm_on_tiles<Int4Weights>(x, w, y, y_stride);
}

void gemm_int8(const Activations& x, const PackedGroups& w, float* y, size_t y_stride) {
  if (!tiles_fit<Int8Weights>(x, w)) return avx512::paths().int8(x, w, y, y_stride);
  gemm_on_tiles<Int8Weights>(x, w, y, y_stride);
}

double tile_bf16_peak_probe(int64_t iterations) {
#ifdef KT_AMX_EMULATED
  (void)iterations;
  return 0.0;  // software tiles have no peak worth reporting
#else
  // Four independent C tiles, A and B loaded once (zeros: the rate does not depend on the values).
  alignas(64) static const uint8_t zeros[kTileRows * kTileBytes] = {};
  configure_tiles();
  KT_TILE_ZERO(0);
  KT_TILE_ZERO(1);
  KT_TILE_ZERO(2);
  KT_TILE_ZERO(3);
  KT_TILE_LOAD(4, zeros, kTileBytes);
  KT_TILE_LOAD(5, zeros, kTileBytes);
  KT_TILE_LOAD(6, zeros, kTileBytes);
  KT_TILE_LOAD(7, zeros, kTileBytes);
  const int64_t rounds = std::max<int64_t>(iterations / 4, 1);
  for (int64_t i = 0; i < rounds; ++i) block_dots_bf16();
  release_tiles();
  constexpr double kFlopsPerProduct = 2.0 * kTileRows * kTileRows * 2 * kTileRows;  // 16 x 16 outputs, 32 inputs
  return double(rounds) * 4 * kFlopsPerProduct;
#endif
}

}  // namespace amx
KT_NAMESPACE_END
