// Packing into the layouts described in kernels.h (shared by every build).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "bf16.h"
#include "kernels.h"

KT_NAMESPACE_BEGIN

void pack_bf16(const bf16_t* weights, int rows, int k, uint8_t* packed) {
  const int k_pairs = round_up(k, 2) / 2;
  const size_t group_bytes = bf16_group_bytes(k);
  for (int g = 0; g < packed_groups(rows); ++g) {
    bf16_t* group = reinterpret_cast<bf16_t*>(packed + g * group_bytes);
    std::memset(group, 0, group_bytes);
    for (int r = 0; r < kGroupRows && g * kGroupRows + r < rows; ++r) {
      const bf16_t* row = weights + size_t(g * kGroupRows + r) * k;
      for (int p = 0; p < k_pairs; ++p) {
        group[(size_t(p) * kGroupRows + r) * 2] = row[2 * p];
        if (2 * p + 1 < k) group[(size_t(p) * kGroupRows + r) * 2 + 1] = row[2 * p + 1];
      }
    }
  }
}

void pack_mxfp4(const uint8_t* codes, const uint8_t* scales, int rows, int k, uint8_t* packed,
                uint8_t* packed_scales) {
  const int blocks = k / kMxfp4Block, row_bytes = k / 2;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * mxfp4_group_bytes(k);
    uint8_t* group_scales = packed_scales + g * mxfp4_group_scale_bytes(k);
    std::memset(group, 0, mxfp4_group_bytes(k));
    std::memset(group_scales, 0, mxfp4_group_scale_bytes(k));
    for (int r = 0; r < kGroupRows && g * kGroupRows + r < rows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int j = 0; j < row_bytes; ++j) {  // byte j = codes of inputs 2j (low) and 2j + 1 (high)
        const uint32_t byte = codes[row * row_bytes + j], shift = 4 * (j % 4);
        uint32_t word;
        uint8_t* at = group + (j / 4) * kMxfp4ChunkBytes + 4 * r;
        std::memcpy(&word, at, sizeof(word));
        word |= ((byte & 0xF) << shift) | ((byte >> 4) << (16 + shift));
        std::memcpy(at, &word, sizeof(word));
      }
      for (int b = 0; b < blocks; ++b) group_scales[b * kGroupRows + r] = scales[row * blocks + b];
    }
  }
}

void pack_int8(const int8_t* q, const float* scales, int rows, int k, uint8_t* packed, uint8_t* packed_scales) {
  const size_t group_bytes = int8_group_bytes(k);
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* group = packed + g * group_bytes;
    float* group_scales = reinterpret_cast<float*>(packed_scales + g * int8_group_scale_bytes(k));
    std::memset(group, kInt8Offset, group_bytes);  // padding = weight 0
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      group_scales[r] = row < size_t(rows) ? scales[row] : 0.0f;
      if (row >= size_t(rows)) continue;
      for (int c = 0; c < k; ++c) group[(c / 4) * 64 + 4 * r + c % 4] = uint8_t(q[row * k + c] + kInt8Offset);
    }
  }
}

void pack_int4(const uint8_t* q, const float* scales, int rows, int k, int group, uint8_t* packed,
               uint8_t* packed_scales) {
  const size_t group_bytes = int4_group_bytes(k);
  const int scale_groups = k / group;
  for (int g = 0; g < packed_groups(rows); ++g) {
    uint8_t* lines = packed + g * group_bytes;
    float* group_scales = reinterpret_cast<float*>(packed_scales + g * int4_group_scale_bytes(k, group));
    std::memset(lines, kInt4Offset | kInt4Offset << 4, group_bytes);  // padding = weight 0
    for (int r = 0; r < kGroupRows; ++r) {
      const size_t row = size_t(g) * kGroupRows + r;
      for (int s = 0; s < scale_groups; ++s)
        group_scales[s * kGroupRows + r] = row < size_t(rows) ? scales[row * scale_groups + s] : 0.0f;
      if (row >= size_t(rows)) continue;
      for (int c = 0; c < k; ++c) {
        const int nibble = (q[row * (k / 2) + c / 2] >> (4 * (c % 2))) & 0xF;
        const int offset_value = (nibble ^ 8);  // two's complement -8..7 -> 0..15 = q + 8
        uint8_t& byte = lines[(c / 8) * 64 + 4 * r + c % 4];
        const int shift = 4 * ((c % 8) / 4);  // inputs 8c+4..8c+7 in the high nibbles
        byte = uint8_t((byte & ~(0xF << shift)) | offset_value << shift);
      }
    }
  }
}

void order_octets_for_mxfp4(int8_t* values, int count) {
  constexpr int kOctetOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int c = 0; c < count; c += 8) {
    int8_t octet[8];
    std::memcpy(octet, values + c, sizeof(octet));
    for (int j = 0; j < 8; ++j) values[c + j] = octet[kOctetOrder[j]];
  }
}

namespace {

void sum_blocks(const int8_t* values, int stride, int32_t* block_sums) {
  for (int b = 0; b < stride / kActivationBlock; ++b) {
    int32_t sum = 0;
    for (int c = 0; c < kActivationBlock; ++c) sum += values[b * kActivationBlock + c];
    block_sums[b] = sum;
  }
}

}  // namespace

void quantize_activation_row(const bf16_t* x, int k, int stride, QuantizedRowOut row, const QuantizedRowOut* residual) {
  // The largest magnitude, as the largest bf16 bit pattern without its sign: an integer maximum
  // vectorizes, a float one does not without -ffast-math. (A NaN makes the row NaN.)
  uint16_t amax_bits = 0;
  for (int c = 0; c < k; ++c) amax_bits = std::max(amax_bits, uint16_t(x[c] & 0x7FFFu));
  const float amax = bf16_to_float(amax_bits);
  const float scale = amax / 127.0f;
  *row.scale = scale;
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int c = 0; c < k; ++c) row.values[c] = int8_t(std::nearbyint(bf16_to_float(x[c]) * inverse));
  std::memset(row.values + k, 0, stride - k);
  sum_blocks(row.values, stride, row.block_sums);
  if (residual == nullptr) return;
  // What the row leaves, |x - scale * q| <= scale / 2, in steps of scale / 254.
  *residual->scale = scale / kResidualSteps;
  const float residual_inverse = inverse * kResidualSteps;
  for (int c = 0; c < k; ++c) {
    const float rest = bf16_to_float(x[c]) - scale * float(row.values[c]);
    const float q = std::nearbyint(rest * residual_inverse);
    residual->values[c] = int8_t(std::min(std::max(q, -127.0f), 127.0f));
  }
  std::memset(residual->values + k, 0, stride - k);
  sum_blocks(residual->values, stride, residual->block_sums);
}

KT_NAMESPACE_END
