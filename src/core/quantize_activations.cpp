// Activation rows quantized for the integer kernels (kernels.h), shared by every build.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "bf16.h"
#include "kernels.h"

KT_NAMESPACE_BEGIN

void order_octets_for_mxfp4(int8_t* values, int count) {
  constexpr int kOctetOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int c = 0; c < count; c += 8) {
    int8_t octet[8];
    std::memcpy(octet, values + c, sizeof(octet));
    for (int j = 0; j < 8; ++j) values[c + j] = octet[kOctetOrder[j]];
  }
}

namespace {

void sum_running(const int8_t* values, int stride, int32_t* running_sums) {
  running_sums[0] = 0;
  for (int b = 0; b < stride / kSumBlock; ++b) {
    int32_t sum = 0;
    for (int c = 0; c < kSumBlock; ++c) sum += values[b * kSumBlock + c];
    running_sums[b + 1] = running_sums[b] + sum;
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
  sum_running(row.values, stride, row.running_sums);
  if (residual == nullptr) return;
  // What the row leaves, |x - scale * q| <= scale / 2, in steps of scale / 256 (a power of two:
  // the 4-bit tiles add 256 x the row's sums to the residual's; 128 steps clamp to 127). The
  // pointers are copied to locals and clamped as integers, so the loop vectorizes (scalar, it took
  // 4 % of an MXFP4 prefill).
  *residual->scale = scale / kResidualSteps;
  const float residual_inverse = inverse * kResidualSteps;
  const int8_t* const values = row.values;
  int8_t* const rest_values = residual->values;
  for (int c = 0; c < k; ++c) {
    const float rest = bf16_to_float(x[c]) - scale * float(values[c]);
    rest_values[c] = int8_t(std::clamp(int(std::nearbyint(rest * residual_inverse)), -127, 127));
  }
  std::memset(residual->values + k, 0, stride - k);
  sum_running(residual->values, stride, residual->running_sums);
}

KT_NAMESPACE_END
